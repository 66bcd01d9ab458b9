"""Faults and broken input give a clear error (or an answer from the
ledger), never a long hang, a traceback or an internal error. Real sshd test hosts.

Bad inputs and faults tried: a host whose sshd is gone (status, cost, logs, down, down --force),
an --identity file that does not exist, a host that accepts TCP and never says a word (no SSH
banner), a ledger that is not a database, a home that cannot be written."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from tests.integration.test_guards import ticks
from tests.integration.test_ssh import up_ssh
from tests.waits import wait_for


def timed(gpuctl, *args, code=0):
    t0 = time.monotonic()
    res = gpuctl(*args, code=code)
    return res, time.monotonic() - t0


def test_an_unreachable_host_gets_answers_from_the_ledger_and_down_force(gpuctl, ssh, make_project):
    host = ssh.hosts[0]
    up_ssh(gpuctl, ssh)
    proj = make_project("long", {"train.py": "import time\nprint('epoch 1', flush=True)\ntime.sleep(600)\n"})
    run_id = json.loads(gpuctl("train", str(proj), "--allow-cpu", "--json").stdout)["run"]["run_id"]
    host.stop()  # its sshd is gone (a host powered off by hand, a network that went away)
    try:
        res, took = timed(gpuctl, "status")
        assert took < 20, took  # was ~120 s, then exit 7
        assert "not reachable" in res.stdout and run_id in res.stdout
        res, took = timed(gpuctl, "cost")
        assert took < 20 and "box" in res.stdout
        res, took = timed(gpuctl, "logs", run_id, code=7)
        assert took < 20 and "Traceback" not in res.stderr
        res = gpuctl("down", "-y", code=7)
        assert "--force" in res.stderr and "Traceback" not in res.stderr
        assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "up"  # nothing released
        res, took = timed(gpuctl, "down", "--force", "-y")
        assert "not reachable" in res.stderr and took < 40
        assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"
    finally:
        host.restart()


def test_a_missing_identity_file_fails_at_once_and_records_nothing(gpuctl, ssh, tmp_path):
    res, took = timed(gpuctl, "up", "--provider", "ssh", "--host", ssh.hosts[0].address,
                      "--identity", str(tmp_path / "no-such-key"), code=3)
    assert took < 10 and "no-such-key: no such file" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_a_host_that_never_sends_a_banner_is_one_line_not_a_traceback(gpuctl, isolated, monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])  # and say nothing
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "2")
    try:
        res = gpuctl("up", "--provider", "ssh", "--host", f"root@127.0.0.1:{server.getsockname()[1]}", code=7)
    finally:
        server.close()
    assert "Traceback" not in res.stderr and "Exception" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3, res.stderr  # error and hint


def test_a_broken_ledger_or_home_names_the_file(gpuctl, isolated):
    isolated.mkdir(mode=0o700, exist_ok=True)
    (isolated / "ledger.sqlite3").write_bytes(b"this is not a database" * 100)
    res = gpuctl("status", code=3)
    assert f"the ledger {isolated / 'ledger.sqlite3'} cannot be read" in res.stderr and "mv " in res.stderr
    (isolated / "ledger.sqlite3").unlink()
    if os.geteuid() != 0:  # root writes anywhere: a read-only home cannot be made for root
        os.chmod(isolated, 0o500)
        res = gpuctl("status", code=3)
        assert str(isolated) in res.stderr and "internal error" not in res.stderr


def test_what_looked_like_success_is_an_error_now(gpuctl, make_project, isolated, tmp_path):
    """Local provider: each of these said it worked, or failed with an internal error."""
    gpuctl("up", "--provider", "local")
    proj = make_project("p", {"train.py": "print('hi')\n"})
    (tmp_path / "plots.png").mkdir()
    assert "it is a directory" in gpuctl("cost", "--plot", str(tmp_path / "plots.png"), code=3).stderr
    (tmp_path / "data.bin").write_text("x")
    assert "is a file, not a directory" in gpuctl("sync", str(proj), "--data", str(tmp_path / "data.bin"), code=6).stderr
    gpuctl("train", str(proj), "--wait")
    res = gpuctl("pull", "--dest", "/proc/nope", code=3)
    assert "cannot write to --dest '/proc/nope'" in res.stderr and "internal error" not in res.stderr
    assert "99999 is not in the range" in gpuctl("tensorboard", "--port", "99999", code=2).stderr


@pytest.mark.tf  # two real TensorBoards, which load TensorFlow: ~15 s each
def test_a_second_tensorboard_on_another_port_serves_there(gpuctl, isolated):
    """The second `tensorboard --port` printed a URL nothing served (local provider,
    where the instance's port is the one asked)."""
    import subprocess
    import sys

    from tests.integration.test_secrets_tensorboard import owner_gets_the_page

    gpuctl("up", "--provider", "local")
    for port in (16131, 16132):
        proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "tensorboard", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()  # printed once TensorBoard serves
            assert f"http://127.0.0.1:{port}/?token=" in line, proc.stderr.read()
            owner_gets_the_page(line.split()[1])  # with its token (test_secrets_tensorboard.py)
        finally:
            proc.terminate()
            proc.wait(10)
    gpuctl("down", "-y")


def test_an_entry_point_that_is_a_link_out_of_the_project_is_refused(gpuctl, make_project, isolated, tmp_path):
    """New-user trial: the push leaves such a link out, so the run could only fail after starting."""
    gpuctl("up", "--provider", "local")
    outside = tmp_path / "elsewhere.py"
    outside.write_text("print('hi')\n")
    proj = make_project("linked", {"README": "x"})
    (proj / "train.py").symlink_to(outside)
    res = gpuctl("train", str(proj), code=6)
    assert "is a link to a file outside the project" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []


def test_pull_refuses_a_destination_inside_the_home(gpuctl, make_project, isolated):
    """New-user trial: --dest at the run's own directory copied the run into itself until the
    path was too long (an internal error, and a polluted run)."""
    gpuctl("up", "--provider", "local")
    proj = make_project("p", {"train.py": "print('hi')\n"})
    run = json.loads(gpuctl("train", str(proj), "--wait", "--json").stdout)["run"]
    res = gpuctl("pull", run["run_id"], "--dest", run["run_dir"], code=3)
    assert "inside gpuctl's home" in res.stderr and "internal error" not in res.stderr


@pytest.mark.slow  # real idle limits pass, twice (~12 s)
def test_a_shorter_interval_applies_at_once_and_idle_fires_once_per_stretch(gpuctl, make_project, isolated,
                                                                             monkeypatch):
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "60s")
    gpuctl("up", "--provider", "local")
    proj = make_project("p", {"train.py": "print('hi')\n"})
    gpuctl("train", str(proj), "--wait")  # arms the local watchdog, checking every minute
    guard = isolated / "clusters" / "default" / "guard"
    t0 = time.monotonic()
    gpuctl("guard", "set", "--check-interval", "1s", "--idle", "3s")
    wait_for((guard / "fired.json").exists, 30, "the idle fire")
    took = time.monotonic() - t0
    assert took < 3 + 1 + 4, took  # not the rest of a 60 s sleep
    # Two more idle limits with nothing happening: until the watchdog has looked past them.
    fired_at = json.loads((guard / "fired.json").read_text())["at"]
    wait_for(lambda: [t for t, _ in ticks((guard / "decisions.log").read_text()) if t >= fired_at + 3 * 2 + 1], 30,
             "the watchdog's looks past two more idle limits")
    log = (guard / "decisions.log").read_text()
    assert log.count("FIRE idle") == 1, log
    gpuctl("down", "-y")
