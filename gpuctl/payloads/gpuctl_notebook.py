"""JupyterLab for `gpuctl notebook`, on 127.0.0.1 only, behind a token no command line carries.

    python gpuctl_notebook.py DIR WORKDIR PORT

DIR is the notebook's own directory (the owner's alone): the token is read from DIR/token, the
port (PORT, 0: a free one chosen here) written to DIR/port, Jupyter's config (the token in it)
to DIR/jupyter_config.py, mode 0600; argv and the environment carry no token (other users of the
host see argv). JupyterLab runs in this process (`jupyter lab` would be a second interpreter),
its notebooks' root WORKDIR. Once it answers its own API with the token, DIR/serving is written.
A thread follows the watchdog's state (ROOT/guard/state.json): when the idle guard is about to
fire, a line here says so (this is the server's log). Runs on the instance: stdlib and JupyterLab.
"""

import json
import os
import socket
import sys
import threading
import time
import urllib.request

from gpuctl_tensorboard import read_token  # the same private token file, read alike

FOLLOW_S = 2.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_private(path, text):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def say(text):
    sys.stderr.write("[gpuctl] %s %s\n" % (time.strftime("%H:%M:%S"), text))
    sys.stderr.flush()


def answers(port, token):
    req = urllib.request.Request("http://127.0.0.1:%d/api/status" % port, headers={"Authorization": "token " + token})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False


def watch_serving(folder, port, token):
    """DIR/serving while the server answers its API with the token (the client waits for that
    file, and reconnects only to a server that has it): written once it answers, removed once it
    stops answering (a server shutting down, or hung in its shutdown)."""
    serving = os.path.join(folder, "serving")
    while not answers(port, token):
        time.sleep(0.2)
    write_private(serving, "%d\n" % port)
    misses = 0
    while misses < 2:
        time.sleep(FOLLOW_S)
        misses = 0 if answers(port, token) else misses + 1
    try:
        os.remove(serving)
    except OSError:
        pass


def follow_guard(state_path):
    """A line in this log when the idle guard will end this server soon (each warning once)."""
    said = None
    while True:
        try:
            with open(state_path) as fh:
                state = json.loads(fh.read(1 << 20))
            at = state.get("idle_warning") if isinstance(state, dict) else None
            at = float(at) if isinstance(at, (int, float)) else None
        except (OSError, ValueError, TypeError):
            at = None
        if at is not None and at != said:
            say("WARNING: the kernels are idle: the cluster's idle guard ends this notebook server (and, "
                "on a cloud instance, the instance) at %s, in %.0fs. Run a cell to keep it, or raise the limit: "
                "`gpuctl guard set --idle 2h`." % (time.strftime("%H:%M:%S", time.localtime(at)), at - time.time()))
        said = at
        time.sleep(FOLLOW_S)


def main(argv):
    folder, workdir, port = argv[1], argv[2], int(argv[3])
    token = read_token(os.path.join(folder, "token"))
    port = port or free_port()
    config = os.path.join(folder, "jupyter_config.py")
    # A kernel's shutdown is bounded (the watchdog's SIGTERM must end the server within its grace).
    write_private(config, "c.ServerApp.token = %r\nc.ServerApp.password = ''\nc.KernelManager.shutdown_wait_time = 2.0\n"
                  % token
                  + ("c.ServerApp.allow_root = True\n" if os.geteuid() == 0 else ""))  # a root login on the host
    write_private(os.path.join(folder, "port"), "%d\n" % port)
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(folder, "runtime")
    root = os.path.dirname(os.path.abspath(folder))
    for target, args in ((watch_serving, (folder, port, token)),
                         (follow_guard, (os.path.join(root, "guard", "state.json"),))):
        threading.Thread(target=target, args=args, daemon=True).start()
    from jupyterlab.labapp import LabApp

    say("JupyterLab on 127.0.0.1:%d (the token is in %s, the owner's alone)" % (port, os.path.join(folder, "token")))
    LabApp.launch_instance(argv=["--config=" + config, "--ServerApp.ip=127.0.0.1", "--ServerApp.port=%d" % port,
                                 "--ServerApp.port_retries=0", "--ServerApp.open_browser=False",
                                 "--ServerApp.root_dir=" + workdir])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
