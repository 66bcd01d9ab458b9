"""`gpuctl notebook` on an sshd test host (its own network namespace), with the real JupyterLab
of the venv the hosts run (tests/sshd.py: the jobs' Python is this checkout's .venv): reached
only through the SSH forward gpuctl opens with its pinned host key, listening on the host's
127.0.0.1 alone (not from this machine, another host's namespace, nor the host's own address);
Ctrl-C ends the forward and not the server, which the next `gpuctl notebook` reconnects to.

Bad input tried: a Python whose JupyterLab cannot be installed (a venv without pip: one line
with pip's last line, nothing left running, no session recorded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.test_notebook import _gone, api, free_port, nowhere_in_processes, token_of, url_in
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT
from tests.waits import wait_for

pytestmark = pytest.mark.slow


def reachable_from(where: list[str], address: str, port: int) -> bool:
    """A TCP connection to address:port opens from that network namespace (bash's /dev/tcp)."""
    res = subprocess.run([*where, "timeout", "5", "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"],
                         capture_output=True, text=True)
    return res.returncode == 0


def test_the_notebook_is_reached_through_the_forward_only_and_outlives_ctrl_c(gpuctl, ssh, make_project):
    up_ssh(gpuctl, ssh)
    host, other = ssh.hosts[0], ssh.hosts[1]
    proj = make_project("nb", {"train.py": "print('hi')\n"})
    port = free_port()
    proc = subprocess.Popen([str(REPO / ".venv/bin/gpuctl"), "notebook", "--no-open", "--port", str(port), str(proj)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://" in line, line + (proc.stderr.read() if proc.poll() is not None else "")
        url = url_in(line)
        token = token_of(url)
        assert f"127.0.0.1:{port}/" in url
        wait_for(lambda: api(url, "/api/status", token)[0] == 200 if not _gone(url) else None, 30, "the tunnel")
        assert api(url, "/api/status")[0] == 403
        nowhere_in_processes(token)  # this machine's processes are the host's too (one pid namespace)
        remote = int(host.run(f"cat {ROOT}/notebook/port").stdout.strip())
        listening = host.run("cat /proc/net/tcp").stdout
        assert f"0100007F:{remote:04X}" in listening and f"00000000:{remote:04X}" not in listening
        on_host = ["nsenter", "-t", str(host.proc.pid), "-n"]
        on_other = ["nsenter", "-t", str(other.proc.pid), "-n"]
        assert reachable_from(on_host, "127.0.0.1", remote)  # it does listen there
        assert not reachable_from(on_other, host.address, remote)
        assert not reachable_from(on_host, host.address, remote)
        assert not reachable_from([], host.address, remote)
        assert host.run(f"runuser -u nobody -- cat {ROOT}/notebook/token").returncode != 0
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the forward ends, gpuctl with it
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
    wait_for(lambda: _gone(url), 15, "the forward's end")
    assert reachable_from(on_host, "127.0.0.1", remote)  # the server goes on
    again = subprocess.Popen([str(REPO / ".venv/bin/gpuctl"), "notebook", "--no-open", "--port", str(port), str(proj)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = again.stdout.readline()
        assert url_in(line) == url and "reconnected" in line, line
        wait_for(lambda: api(url, "/api/status", token)[0] == 200 if not _gone(url) else None, 30, "the tunnel again")
    finally:
        again.send_signal(signal.SIGINT)
        again.wait(15)
    assert "stopped" in gpuctl("notebook", "--stop").stdout
    wait_for(lambda: not reachable_from(on_host, "127.0.0.1", remote), 20, "the server's end")
    gpuctl("down", "-y")


def test_jupyterlab_that_cannot_be_installed_one_line_nothing_left_running(gpuctl, ssh, make_project, monkeypatch,
                                                                          tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", str(bare / "bin" / "python"))
    up_ssh(gpuctl, ssh)
    host = ssh.hosts[0]
    res = gpuctl("notebook", "--no-open", make_project("nb", {"train.py": ""}), code=7)
    error = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "JupyterLab could not be installed" in error[0], res.stderr
    assert "No module named pip" in error[0] and "Hint:" in res.stderr
    assert host.run(f"ls {ROOT}/notebook/token").returncode != 0
    assert not _notebook_servers_on(host)
    assert json.loads(gpuctl("status", "--json").stdout)["notebooks"] == []
    gpuctl("down", "-y")


def _notebook_servers_on(host) -> list[bytes]:
    """Notebook servers in the host's own mount namespace (the pid namespace is this machine's,
    where other tests' servers may run at the same time)."""
    ns = os.readlink(f"/proc/{host.proc.pid}/ns/mnt")
    out = []
    for pid in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(pid / "ns" / "mnt") == ns and b"gpuctl_notebook.py" in (pid / "cmdline").read_bytes():
                out.append((pid / "cmdline").read_bytes())
        except OSError:
            continue
    return out
