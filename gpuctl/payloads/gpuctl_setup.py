"""gpuctl's setup step, run on the instance with its system python3: a venv with one pinned
TensorFlow, made once and marked ready. Stdlib only; Python 3.8+.

    gpuctl_setup.py probe   --root ROOT --tensorflow 2.21     one JSON line: what is there now
    gpuctl_setup.py install --root ROOT --tensorflow 2.21 [--wheelhouse DIR] [--variant auto|cuda|cpu]
    gpuctl_setup.py log     --root ROOT --tensorflow 2.21     the install log

The venv is ROOT/_envs/tf-VERSION; next to it VERSION.log (everything pip said), .lock (one
install at a time, across clusters sharing the host) and .result.PID.json (how the install with
that pid ended: one file each, so two installs that ran one after the other never read the
other's). The venv counts as ready only with its marker (.gpuctl-ready), written after TensorFlow
imported from it at the asked version: an install killed half-way is removed and made again.
"""

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

MARKER = ".gpuctl-ready"
# Where the Deep Learning AMIs keep TensorFlow: a venv on current ones, conda envs on older ones.
CANDIDATES = (
    "/opt/tensorflow/bin/python3",
    "/opt/conda/envs/tensorflow/bin/python",
    "~/anaconda3/envs/tensorflow2_p310/bin/python",
    "~/anaconda3/envs/tensorflow2_p39/bin/python",
    "/opt/conda/bin/python",
)
VERSION_OF_TF = (
    "import importlib.metadata as m\n"
    "for d in ('tensorflow', 'tensorflow-cpu', 'tensorflow-gpu', 'tf-nightly'):\n"
    "    try:\n        print(m.version(d)); break\n    except m.PackageNotFoundError:\n        pass\n"
)
ATTEMPTS = 3  # a flaky download gets two more tries, after 10 s and 30 s
BACKOFF_S = (10, 30)
# What pip says when trying again cannot help: the version does not exist (for this Python).
PERMANENT = ("No matching distribution found", "Could not find a version that satisfies")
# pip says "found no version" also when it never reached the index: these in its log say why.
NO_NETWORK = ("Temporary failure in name resolution", "Name or service not known", "NewConnectionError",
              "Failed to establish a new connection", "Network is unreachable", "No route to host")


def paths(root, version):
    # "_envs": no cluster is named so (names start with a letter or digit), whose WORKDIR/NAME it would be.
    envs = os.path.join(os.path.expanduser(root), "_envs")
    env = os.path.join(envs, "tf-" + version)
    return {"envs": envs, "env": env, "python": os.path.join(env, "bin", "python"), "log": env + ".log",
            "lock": env + ".lock", "result": env + ".result.%d.json" % os.getpid(), "marker": os.path.join(env, MARKER)}


def matches(found: Optional[str], asked: str) -> bool:
    """'2.21' asks for any 2.21.x; '2.21.0' for exactly that."""
    if not found:
        return False
    return found == asked or found.startswith(asked + ".") if asked.count(".") == 1 else found == asked


def tf_version(python):
    """The TensorFlow distribution version installed for that interpreter (no import: fast)."""
    try:
        out = subprocess.run([python, "-c", VERSION_OF_TF], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def has_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def read_json(path: str) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def ready_env(p, asked):
    """(env dir, marker) of a ready env of gpuctl's with the asked version: its own dir first,
    then any other (a "2.21" install serves "2.21.0", an image baked for "2.21.0" serves "2.21")."""
    dirs = [p["env"]] + sorted(os.path.join(p["envs"], d) for d in (os.listdir(p["envs"]) if os.path.isdir(p["envs"]) else [])
                               if d.startswith("tf-") and os.path.join(p["envs"], d) != p["env"])
    for env in dirs:
        marker = read_json(os.path.join(env, MARKER))
        if isinstance(marker, dict) and matches(marker.get("tensorflow"), asked) \
                and os.access(os.path.join(env, "bin", "python"), os.X_OK):
            return env, marker
    return None, None


def probe(args):
    p = paths(args.root, args.tensorflow)
    env, marker = ready_env(p, args.tensorflow)
    found: List[Dict[str, Optional[str]]] = []
    if not env:
        # An image's own TensorFlow, or the host's python3 (a lab machine with TF installed).
        for cand in CANDIDATES + tuple(filter(None, [shutil.which("python3")])):
            path = os.path.expanduser(cand)
            if os.access(path, os.X_OK) and path not in [f["python"] for f in found]:
                found.append({"python": path, "tensorflow": tf_version(path)})
    lock_free = True
    if os.path.exists(p["lock"]):
        with open(p["lock"], "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock_free = False  # an install holds it now
    print(json.dumps({
        "env": p["env"], "python": os.path.join(env, "bin", "python") if env else p["python"], "log": p["log"],
        "log_size": os.path.getsize(p["log"]) if os.path.exists(p["log"]) else 0,
        "ready": marker, "ready_env": env, "installing": not lock_free,
        "found": [f for f in found if matches(f["tensorflow"], args.tensorflow)], "others": found,
        "gpu": has_gpu(), "system_python": sys.executable, "system_version": "%d.%d" % sys.version_info[:2],
    }))


class Log:
    def __init__(self, path: str) -> None:
        self.fh = open(path, "a", buffering=1)

    def step(self, text: str) -> None:
        # The CLI shows these lines as progress; everything else is the log's.
        self.fh.write("gpuctl-setup: %s\n" % text)

    def run(self, argv: List[str], env: Optional[Dict[str, str]] = None) -> int:
        self.fh.write("$ %s\n" % " ".join(argv))
        return subprocess.run(argv, stdout=self.fh, stderr=subprocess.STDOUT, env=env).returncode


def make_venv(p, log):
    if log.run([sys.executable, "-m", "venv", p["env"]]) == 0:
        return
    # Ubuntu's python3 lacks ensurepip until python3-venv is installed.
    shutil.rmtree(p["env"], ignore_errors=True)
    log.step("python3 -m venv failed: installing python3-venv (sudo apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["sudo", "-n", "apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"], ["sudo", "-n", "apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q", "python3-venv"]):
        log.run(argv, env=env)
    if log.run([sys.executable, "-m", "venv", p["env"]]) != 0:
        raise SystemExit("cannot make a venv with %s (install python3-venv, or set remote.python)" % sys.executable)


def requirements(version, variant):
    pin = "==%s.*" % version if version.count(".") == 1 else "==" + version
    # tf-keras numbers its patches apart from TensorFlow's (2.20.1 for TF 2.20.0): same minor only.
    keras = "==%s.*" % ".".join(version.split(".")[:2])
    # TensorBoard: TensorFlow no longer depends on it, and `gpuctl tensorboard` runs it from this env.
    if variant == "cuda":
        return [["tensorflow[and-cuda]" + pin, "tf-keras" + keras, "tensorboard"]]
    # tf-keras asks for `tensorflow`, which tensorflow-cpu provides under another name: without
    # --no-deps pip would fetch the full build as well.
    return [["tensorflow-cpu" + pin, "tensorboard"], ["--no-deps", "tf-keras" + keras]]


def pip_install(p, args, variant, log):
    # pip's own retries are per request, with backoff: 5 of them cost ~8 s per package on a host
    # that cannot reach the index (6 minutes before "no network" for TensorFlow's ~30). This loop
    # already tries the whole install ATTEMPTS times, so pip retries a request twice only.
    base = [p["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "--retries", "2", "--timeout", "60"]
    if args.wheelhouse:
        base += ["--no-index", "--find-links", os.path.expanduser(args.wheelhouse)]
    for reqs in requirements(args.tensorflow, variant):
        for attempt in range(1, ATTEMPTS + 1):
            log.step("pip install %s (attempt %d of %d)" % (" ".join(r for r in reqs if r[0] != "-"), attempt, ATTEMPTS))
            start = log.fh.tell()
            if log.run(base + reqs) == 0:
                break
            with open(log.fh.name) as fh:
                fh.seek(start)
                said = fh.read()
            if any(p in said for p in PERMANENT) and not args.wheelhouse and any(n in said for n in NO_NETWORK):
                raise SystemExit("no network to the package index (pip could not reach it to find %s)" % (
                    " ".join(r for r in reqs if r[0] != "-")))
            if any(p in said for p in PERMANENT):
                raise SystemExit("pip found no %s for Python %d.%d%s" % (
                    " ".join(r for r in reqs if r[0] != "-"), sys.version_info[0], sys.version_info[1],
                    " in the wheelhouse" if args.wheelhouse else ""))
            if attempt == ATTEMPTS:
                raise SystemExit("pip install %s failed %d times (see the log)" % (" ".join(reqs), ATTEMPTS))
            time.sleep(BACKOFF_S[attempt - 1])


def last_failure(log_path):
    """Why the latest install in the log failed, if the latest one did (its last step says so)."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log_path) - 65536))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    steps = [ln[len("gpuctl-setup: "):] for ln in tail.splitlines() if ln.startswith("gpuctl-setup: ")]
    return steps[-1][len("failed: "):] if steps and steps[-1].startswith("failed: ") else None


@contextlib.contextmanager
def outcome(log: Log, result: Dict[str, Any], env: str, result_path: str, started: float) -> Iterator[None]:
    """The install's result file, however the block ends: `result` as it set it, else why it failed
    (a SystemExit's words, any other error's type), its half-made env removed. Shared by the
    project's packages (gpuctl_packages.py)."""
    try:
        yield
    except SystemExit as exc:
        result["error"] = str(exc.code)
        log.step("failed: %s" % exc.code)
    except Exception as exc:  # noqa: BLE001 - the result file must say why, whatever it was
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        log.step("failed: %s" % result["error"])
    finally:
        if not result["ok"]:
            shutil.rmtree(env, ignore_errors=True)  # a venv half made helps nobody: free the disk
        result["seconds"] = round(time.time() - started, 1)
        tmp = result_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, result_path)


def install(args):
    p = paths(args.root, args.tensorflow)
    os.makedirs(p["envs"], exist_ok=True)
    started = time.time()
    with open(p["lock"], "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:  # another install of the same version (a cluster, a node with this home): wait
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        log = Log(p["log"])
        result = {"ok": False, "pid": os.getpid(), "started": started, "tensorflow": None, "python": p["python"]}
        with outcome(log, result, p["env"], p["result"], started):
            env, marker = ready_env(p, args.tensorflow)
            if env:
                log.step("ready already (made by an earlier install)")
                result.update(ok=True, tensorflow=marker.get("tensorflow"), skipped=True,
                              python=os.path.join(env, "bin", "python"))
                return
            failed = last_failure(p["log"]) if waited else None
            if failed:
                # The install this one waited for failed just now, on the same host and settings: another
                # at once would fail the same way after as long (nodes sharing one home set up one env).
                log.step("not tried again: the install that held the lock failed a moment ago")
                raise SystemExit(failed)
            variant = args.variant if args.variant != "auto" else ("cuda" if has_gpu() else "cpu")
            log.step("setting up TensorFlow %s (%s) in %s with %s" % (args.tensorflow, variant, p["env"], sys.executable))
            shutil.rmtree(p["env"], ignore_errors=True)  # a half-made one from a killed install
            make_venv(p, log)
            pip_install(p, args, variant, log)
            log.step("checking that TensorFlow imports")
            check = subprocess.run([p["python"], "-c", "import tensorflow as tf; print(tf.__version__)"],
                                   capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
            found = check.stdout.strip().splitlines()[-1] if check.stdout.strip() else ""
            if check.returncode != 0 or not matches(found, args.tensorflow):
                log.fh.write(check.stderr[-4000:])
                raise SystemExit("TensorFlow from the new venv %s (asked %s)" % (
                    "reports %s" % found if found else "does not import", args.tensorflow))
            marker = {"tensorflow": found, "asked": args.tensorflow, "variant": variant,
                      "python": "%d.%d.%d" % sys.version_info[:3], "seconds": round(time.time() - started, 1),
                      "made_at": time.time(), "wheelhouse": bool(args.wheelhouse)}
            with open(p["marker"], "w") as fh:
                json.dump(marker, fh)
            result.update(ok=True, tensorflow=found, variant=variant)
            log.step("ready: TensorFlow %s in %.0f s" % (found, time.time() - started))
    sys.exit(0 if result["ok"] else 1)


def show_log(args):
    p = paths(args.root, args.tensorflow)
    try:
        with open(p["log"]) as fh:
            sys.stdout.write(fh.read())
    except OSError:
        sys.stderr.write("no setup log at %s\n" % p["log"])
        sys.exit(4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["probe", "install", "log"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--tensorflow", required=True)
    parser.add_argument("--wheelhouse", default="")
    parser.add_argument("--variant", choices=["auto", "cuda", "cpu"], default="auto")
    args = parser.parse_args()
    if not re.match(r"^[0-9]+\.[0-9]+(\.[0-9]+)?$", args.tensorflow):  # it becomes a directory name
        parser.error("--tensorflow must look like 2.21 or 2.21.0")
    {"probe": probe, "install": install, "log": show_log}[args.command](args)


if __name__ == "__main__":
    main()
