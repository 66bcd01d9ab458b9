"""`gpuctl notebook` on the local provider with a real JupyterLab (the test venv's, from the
package index): reached with its token (an HTTP request to its API), the token in no process's
argv or environment, a busy kernel (a long cell, run through jupyter_client) holding the idle
guard off, idle kernels letting it fire after a warning in `status` and the server's log,
reconnect, a local port in use, --stop, down, the session's dollars in `cost`. Over SSH (the
port reachable from no other network namespace): test_notebook_ssh.py.

Bad inputs tried: no cluster up; a local port in use (the next free one, said); a Python whose
JupyterLab cannot be installed (test_notebook_ssh.py); the cluster's idle guard fired meanwhile
(said; a new server)."""

from __future__ import annotations

import json
import re
import socket
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.waits import wait_for

pytestmark = pytest.mark.slow  # a real JupyterLab starts in ~5-10 s on two cores


def api(url: str, path: str, token: str | None = None, method: str = "GET") -> tuple[int, object]:
    base = url.split("/lab")[0]
    req = urllib.request.Request(base + path, method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, None


def token_of(url: str) -> str:
    return url.rsplit("token=", 1)[1]


def url_in(out: str) -> str:
    m = re.search(r"http://127\.0\.0\.1:\d+/lab\?token=[\w-]+", out)
    assert m, out
    return m.group(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nowhere_in_processes(token: str) -> None:
    """No process on this machine has the token in its argv or environment; nor does `ps` say it."""
    for pid in Path("/proc").glob("[0-9]*"):
        try:
            seen = (pid / "cmdline").read_bytes() + (pid / "environ").read_bytes()
        except OSError:
            continue
        assert token.encode() not in seen, (pid / "cmdline").read_bytes()
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert token not in ps


@pytest.fixture
def local_up(gpuctl, monkeypatch):
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "3.6")
    gpuctl("up", "--provider", "local", "-y")
    return gpuctl


def test_local_notebook_reached_with_its_token_reconnect_stop_down_and_its_dollars(local_up, make_project, isolated,
                                                                                   monkeypatch):
    gpuctl = local_up
    proj = make_project("nb", {"train.py": "print('hi')\n", "helper.py": "X = 1\n"})
    data = make_project("digits", {"a.csv": "1,2\n"})
    port = free_port()
    first = gpuctl("notebook", "--no-open", "--port", port, "--data", data, proj)
    url = url_in(first.stdout)
    assert f"127.0.0.1:{port}/" in url and "(started)" in first.stdout
    token = token_of(url)
    status, found = api(url, "/api/status", token)
    assert status == 200 and isinstance(found, dict) and "last_activity" in found
    assert api(url, "/api/status")[0] == 403  # without the token
    assert api(url, "/api/status", token[:-1])[0] == 403
    nowhere_in_processes(token)
    folder = isolated / "clusters" / "default" / "notebook"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("token", "jupyter_config.py"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    # The project as `train` pushes it, its data at the same place a run's is ($GPUCTL_DATA_DIR).
    assert (folder / "work" / "code" / "helper.py").read_text() == "X = 1\n"
    assert (folder / "work" / "data" / "a.csv").read_text() == "1,2\n"
    # Listening on the loopback only.
    assert any(f":{port:04X} 00000000:0000 0A" in line and "0100007F:" in line
               for line in Path("/proc/net/tcp").read_text().splitlines())
    # Again: the running server, the same URL; nothing started anew.
    again = gpuctl("notebook", "--no-open", "--port", port, proj)
    assert url_in(again.stdout) == url and "reconnected" in again.stdout
    assert "as it was pushed at its start" in again.stderr
    # Another project is refused, not served by the first's server (nothing pushed over its files);
    # another --port says where the running server listens.
    other = make_project("other", {"other.py": ""})
    refused = gpuctl("notebook", "--no-open", other, code=5)
    assert f"serves {proj.resolve()}, not {other.resolve()}" in refused.stderr and "--stop" in refused.stderr
    assert not (folder / "work" / "code" / "other.py").exists()
    moved = gpuctl("notebook", "--no-open", "--port", free_port(), proj)
    assert url_in(moved.stdout) == url and f"the running server listens on {port}" in moved.stderr
    # The same project by another spelling reconnects; no PROJECT (here: another directory) too,
    # naming what the server has; a --data is said not to apply to it.
    link = isolated / "nb-link"
    link.symlink_to(proj)
    for spelling in (str(link), str(proj) + "/"):
        assert url_in(gpuctl("notebook", "--no-open", spelling).stdout) == url
    monkeypatch.chdir(isolated)
    plain = gpuctl("notebook", "--no-open", "--data", data)
    assert url_in(plain.stdout) == url and f"has {proj.resolve()} as it was pushed" in plain.stderr
    assert "--data applies to a new server" in plain.stderr and "listens on" not in plain.stderr
    # Its time is a session in status and cost, at the cluster's rate.
    shown = gpuctl("status").stdout
    assert "notebook session" in shown and "open" in shown
    report = json.loads(gpuctl("cost", "--json").stdout)
    (session,) = report["notebooks"]
    assert session["ended_at"] is None and session["usd_per_hour"] == 3.6 and session["usd"] > 0
    stopped = gpuctl("notebook", "--stop")
    assert "stopped" in stopped.stdout
    wait_for(lambda: _gone(url), 20, "the server's end")
    report = json.loads(gpuctl("cost", "--json").stdout)
    (session,) = report["notebooks"]
    assert session["ended_at"] is not None and session["usd"] == pytest.approx(session["seconds"] * 3.6 / 3600)
    assert "No notebook server ran" in gpuctl("notebook", "--stop").stdout
    # A new server (a new token), then `down` ends it.
    url2 = url_in(gpuctl("notebook", "--no-open", "--port", port, proj).stdout)
    assert token_of(url2) != token and api(url2, "/api/status", token_of(url2))[0] == 200
    gpuctl("down", "-y")
    wait_for(lambda: _gone(url2), 20, "the server's end at down")
    sessions = json.loads(gpuctl("cost", "--json").stdout)["notebooks"]
    assert len(sessions) == 2 and all(s["ended_at"] for s in sessions)
    assert "notebook session" in gpuctl("cost").stdout


def _gone(url: str) -> bool:
    try:
        api(url, "/api/status")
    except OSError:
        return True
    return False


def test_a_busy_kernel_holds_the_idle_guard_off_idle_kernels_let_it_fire_after_a_warning(
        gpuctl, make_project, isolated, monkeypatch):
    from jupyter_client import BlockingKernelClient

    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "8s", "STALL": "0", "GRACE": "2s"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    gpuctl("up", "--provider", "local")
    proj = make_project("nb", {"train.py": "print('hi')\n"})
    url = url_in(gpuctl("notebook", "--no-open", "--port", free_port(), proj).stdout)
    token = token_of(url)
    status, kernel = api(url, "/api/kernels", token, method="POST")
    assert status == 201 and isinstance(kernel, dict), status
    folder = isolated / "clusters" / "default" / "notebook"
    guard = isolated / "clusters" / "default" / "guard"
    conn = wait_for(lambda: next(iter((folder / "runtime").glob(f"kernel-{kernel['id']}.json")), None), 30)
    client = BlockingKernelClient()
    client.load_connection_file(str(conn))
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        go = folder / "work" / "go"
        client.execute(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.1)")
        wait_for(lambda: _states(url, token) == ["busy"], 30, "the kernel busy")
        # Twelve looks (1 s apart) that saw the busy kernel: past the 8 s limit, and nothing fired.
        wait_for(lambda: _log(guard).count("1 kernel(s), 1 busy") >= 12, 60, "twelve looks at a busy kernel")
        assert not (guard / "fired.json").exists(), _log(guard)[-2000:]
        go.write_text("")  # the cell ends: the kernel idles
        wait_for(lambda: _states(url, token) == ["idle"], 30, "the kernel idle")
        # A few seconds before it fires: `gpuctl status` says so, and the server's own log.
        shown = wait_for(lambda: (lambda out: out if "kernels are idle" in out else None)(gpuctl("status").stdout),
                         30, "the warning in status")
        assert "the idle guard fires at" in shown and "run a cell" in shown
        fired = wait_for(lambda: (guard / "fired.json").exists() and json.loads((guard / "fired.json").read_text()),
                         30, "the idle guard")
        assert fired["reason"] == "idle"
        log = _log(guard)
        assert log.index("WARN idle") < log.index("FIRE idle")
        server_log = (folder / "output.log").read_text()
        assert "[gpuctl]" in server_log and "WARNING: the kernels are idle" in server_log
        wait_for(lambda: _gone(url), 30, "the server ended by the guard")
    finally:
        client.stop_channels()
    # Again: said, and a new server.
    again = gpuctl("notebook", "--no-open", "--port", free_port(), proj)
    assert "idle guard" in again.stderr and "ended the last notebook server" in again.stderr, again.stdout + again.stderr
    assert api(url_in(again.stdout), "/api/status", token_of(url_in(again.stdout)))[0] == 200
    sessions = json.loads(gpuctl("status", "--json").stdout)["notebooks"]
    assert len(sessions) == 2 and sessions[0]["ended_at"] is not None and sessions[1]["ended_at"] is None
    gpuctl("down", "-y")


def _serving_processes(home: Path) -> list[bytes]:
    """The argv of every process serving a notebook of this gpuctl home."""
    out = []
    for pid in Path("/proc").glob("[0-9]*"):
        try:
            argv = (pid / "cmdline").read_bytes()
        except OSError:
            continue
        if b"gpuctl_notebook.py" in argv and str(home).encode() in argv:
            out.append(argv)
    return out


def _states(url: str, token: str) -> list[str]:
    status, kernels = api(url, "/api/kernels", token)
    return [k["execution_state"] for k in kernels] if status == 200 and isinstance(kernels, list) else []


def _log(guard: Path) -> str:
    try:
        return (guard / "decisions.log").read_text()
    except OSError:
        return ""


# --- bad inputs ---------------------------------------------------------------------------------


def test_no_cluster_up(gpuctl, make_project):
    res = gpuctl("notebook", "--no-open", make_project("nb", {"train.py": ""}), code=5)
    assert "Error: no cluster is up" in res.stderr and "gpuctl up" in res.stderr


def test_a_local_port_in_use_takes_the_next_free_one_and_says_so(local_up, make_project):
    gpuctl = local_up
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = gpuctl("notebook", "--no-open", "--port", port, make_project("nb", {"train.py": ""}))
    url = url_in(res.stdout)
    assert f"port {port} is in use here: using" in res.stderr
    used = int(url.split(":")[2].split("/")[0])
    assert used != port and api(url, "/api/status", token_of(url))[0] == 200
    gpuctl("down", "-y")


def test_a_cluster_its_guard_powered_off_meanwhile_is_said_and_up_offered(gpuctl, aws, make_project):
    """On aws a guard's poweroff ends the instance (shutdown behaviour terminate): moto ends it."""
    from tests.aws import live_instances
    from tests.integration.test_aws import UP

    gpuctl(*UP)
    (inst,) = live_instances(aws)
    aws.terminate_instances(InstanceIds=[inst["InstanceId"]])
    res = gpuctl("notebook", "--no-open", make_project("nb", {"train.py": ""}), code=5)
    error = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "ended meanwhile" in error[0] and "gpuctl up" in res.stderr, res.stderr
    assert "http://" not in res.stdout
