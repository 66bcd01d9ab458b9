"""`down` is the brake: nothing may hold it. Real parts: the local provider (real tmux jobs), a
real `gpuctl train` stopped with SIGSTOP (Ctrl-Z) inside the cluster's lock, a gpuctl home on a
tmpfs of a few MB filled to its last byte, a run log made a 1 GB sparse file.

Each command runs as its own process under a subprocess timeout: a hang fails the test instead of
hanging it (a liveness bound, not a speed claim).

Bad inputs and faults tried: a train stopped while it holds the cluster (down, down --force,
down --all, stop --all), a full disk under the home (status, cost, down, then down again with
room), a run log of 1 GB (sparse) with a home of 8 MB."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import fill
from tests.integration.test_deadlines import gpuctl_proc, marked, wait_for

BOUND_S = 90  # any of these commands ends well inside this, or it hangs
LONG_JOB = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat.rsplit(b")", 1)[1].split()[0] in (b"T", b"t")


# A real `gpuctl train`, stopped (as Ctrl-Z stops it) once it holds the cluster's lock: right
# before it pushes the project.
HELD_TRAIN = textwrap.dedent("""
    import os, signal, sys
    from gpuctl.ops import stages
    real = stages.push_and_check
    def held(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)
    stages.push_and_check = held
    from gpuctl.cli import main
    sys.argv = ["gpuctl", "train", sys.argv[1]]
    main()
""")


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
@pytest.mark.parametrize("down", [["down", "-y"], ["down", "--force", "-y"], ["down", "--all", "-y"]])
def test_a_train_stopped_with_ctrl_z_holds_neither_down_nor_stop(gpuctl, make_project, isolated, down):
    from gpuctl.remote.local import LocalHost

    gpuctl("up", "--provider", "local")
    socket = LocalHost(isolated / "clusters" / "default").tmux_socket
    running = make_project("long", {"train.py": LONG_JOB})
    run = json.loads(gpuctl("train", str(running), "--json").stdout)["run"]["run_id"]
    held = subprocess.Popen([sys.executable, "-c", HELD_TRAIN, str(make_project("held", {"train.py": LONG_JOB}))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _stopped(held.pid))
        if down == ["down", "-y"]:
            res = gpuctl_proc("stop", "--all", bound=BOUND_S)
            assert res.returncode == 0, res.stderr
            assert f"pid {held.pid}, stopped" in res.stderr and "going ahead" in res.stderr
            assert run in res.stdout
        res = gpuctl_proc(*down, bound=BOUND_S)
        assert res.returncode == 0, res.stderr
        assert f"pid {held.pid}, stopped" in res.stderr
        assert "is down" in res.stdout
        assert not marked(socket), "a job of the released cluster still runs"
        # Resumed (`fg`), the train finds its cluster released, says so and starts nothing.
        held.send_signal(signal.SIGCONT)
        out, err = held.communicate(timeout=BOUND_S)
        assert held.returncode == 4, err
        assert "was released" in err and "Traceback" not in err
        assert not marked(socket), "the resumed train started a job on the released cluster"
    finally:
        if held.poll() is None:
            held.send_signal(signal.SIGCONT)
            held.kill()
            held.wait()


def _home_on(disk: Path, monkeypatch) -> Path:
    home = disk / "home"
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    return home


def _integrity(home: Path) -> str:
    db = sqlite3.connect(home / "ledger.sqlite3")
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def test_a_full_disk_under_the_home_holds_neither_status_nor_down(make_project, small_disk, monkeypatch):
    from gpuctl.remote.local import LocalHost

    disk = small_disk(4)
    home = _home_on(disk, monkeypatch)
    assert gpuctl_proc("up", "--provider", "local", "-y", bound=BOUND_S).returncode == 0
    socket = LocalHost(home / "clusters" / "default").tmux_socket
    proj = make_project("long", {"train.py": LONG_JOB})
    res = gpuctl_proc("train", str(proj), "--json", bound=BOUND_S)
    run = json.loads(res.stdout)["run"]["run_id"]
    wait_for(lambda: marked(socket))
    fill(disk)
    # A look still answers, from the ledger as it was; its hint never says to throw it away.
    for look in (["status"], ["cost"]):
        res = gpuctl_proc(*look, bound=BOUND_S)
        assert res.returncode == 0, res.stderr
        assert "default" in res.stdout or run in res.stdout
        assert "Move it aside" not in res.stderr and ".broken" not in res.stderr
    res = gpuctl_proc("down", "-y", bound=BOUND_S)
    assert res.returncode == 0, res.stderr
    assert "is down" in res.stdout
    assert "not recorded in the ledger" in res.stderr and "disk holding it is full" in res.stderr
    assert not marked(socket), "the job outlived down"
    assert _integrity(home) == "ok"
    # With room again, a second down records what the first could not.
    (disk / "filler").unlink()
    res = gpuctl_proc("down", "-y", bound=BOUND_S)
    assert res.returncode == 0, res.stderr
    status = json.loads(gpuctl_proc("status", "--json", bound=BOUND_S).stdout)
    assert [c["state"] for c in status["clusters"]] == ["down"]
    assert _integrity(home) == "ok"


# The job makes its own log a 1 GB file (sparse: free to make), then waits.
GROW = ("import os, time\nos.truncate(os.path.join(os.environ['GPUCTL_RUN_DIR'], 'output.log'), 1 << 30)\n"
        "time.sleep(600)\n")


def _down_with_a_grown_log(make_project, small_disk, monkeypatch, disk_mb: int):
    """A local cluster with its home on a tmpfs of `disk_mb` MB and a run whose log is 1 GB: its
    `down` (which must succeed and end the job); the home, the run's id."""
    from gpuctl.remote.local import LocalHost

    home = _home_on(small_disk(disk_mb), monkeypatch)
    assert gpuctl_proc("up", "--provider", "local", "-y", bound=BOUND_S).returncode == 0
    socket = LocalHost(home / "clusters" / "default").tmux_socket
    res = gpuctl_proc("train", str(make_project("grow", {"train.py": GROW})), "--json", bound=BOUND_S)
    run = json.loads(res.stdout)["run"]["run_id"]
    wait_for(lambda: os.path.getsize(home / "clusters" / "default" / "runs" / run / "output.log") >= 1 << 30)
    res = gpuctl_proc("down", "-y", bound=BOUND_S)
    assert res.returncode == 0, res.stderr
    assert "is down" in res.stdout and not marked(socket)
    return res, home, run


def test_a_huge_log_is_kept_only_as_far_as_it_fits_and_never_holds_down(make_project, small_disk, monkeypatch):
    res, home, run = _down_with_a_grown_log(make_project, small_disk, monkeypatch, 12)
    assert f"kept the last 8.4 MB of run {run}'s log" in res.stderr  # 8 MiB of its end, fits in 12 MB
    assert (home / "logs" / f"{run}.log").stat().st_size == 8 << 20
    assert _integrity(home) == "ok"


def test_a_log_that_does_not_fit_is_skipped_and_said(make_project, small_disk, monkeypatch):
    res, home, run = _down_with_a_grown_log(make_project, small_disk, monkeypatch, 6)
    assert f"logs not kept: {run}:" in res.stderr and "do not fit" in res.stderr
    assert not (home / "logs" / f"{run}.log").exists()


def test_a_log_linked_to_dev_zero_on_the_host_costs_down_nothing(gpuctl, ssh, make_project, isolated):
    """The instance is untrusted: a job that makes its log a link to /dev/zero (which an unbounded
    copy reads for ever, filling this disk) leaves `down` a log of nothing to keep."""
    from tests.integration.test_ssh import up_ssh

    up_ssh(gpuctl, ssh)
    link = "import os, time\nlog = os.path.join(os.environ['GPUCTL_RUN_DIR'], 'output.log')\n" \
           "os.unlink(log)\nos.symlink('/dev/zero', log)\ntime.sleep(600)\n"
    run = json.loads(gpuctl("train", make_project("zero", {"train.py": link}), "--allow-cpu", "--json").stdout)
    run_id, run_dir = run["run"]["run_id"], run["run"]["run_dir"]
    host = ssh.hosts[0]
    wait_for(lambda: host.run(f"test -L {run_dir}/output.log").returncode == 0)
    res = gpuctl_proc("down", "-y", bound=BOUND_S)
    assert res.returncode == 0, res.stderr
    assert "is down" in res.stdout
    assert host.run(f"pgrep -f '[{run_id[0]}]{run_id[1:]}'").stdout.strip() == "", "the job outlived down"
    kept = isolated / "logs" / f"{run_id}.log"
    assert not kept.exists() or kept.stat().st_size <= 8 << 20


@pytest.mark.parametrize("trap", ["fifo", "loop"])
def test_a_log_or_report_file_made_a_trap_holds_neither_status_nor_down(gpuctl, make_project, isolated, trap):
    """A cloned project's job is untrusted: it turns its log, its report file, its start time and
    its exit code file into a FIFO (whose
    open blocks until a writer comes) or a link loop. (A file made unreadable is no trap to root,
    as CI runs: not tried.)"""
    from gpuctl.remote.local import LocalHost

    gpuctl("up", "--provider", "local")
    socket = LocalHost(isolated / "clusters" / "default").tmux_socket
    make = {"fifo": "os.mkfifo(p)", "loop": "os.symlink(p + '.x', p); os.symlink(p, p + '.x')"}[trap]
    job = ("import os, time\nd = os.environ['GPUCTL_RUN_DIR']\n"
           "for name in ('output.log', 'epochs.jsonl', 'started', 'exitcode'):\n"
           "    p = os.path.join(d, name)\n"
           "    if os.path.lexists(p): os.unlink(p)\n"
           f"    {make}\n"
           "open(os.path.join(d, 'trapped'), 'w').close()\ntime.sleep(600)\n")
    run = json.loads(gpuctl("train", str(make_project("trap", {"train.py": job})), "--json").stdout)["run"]
    wait_for(lambda: os.path.exists(os.path.join(run["run_dir"], "trapped")))
    for look in (["status"], ["cost"]):
        res = gpuctl_proc(*look, bound=BOUND_S)
        assert res.returncode == 0 and "internal error" not in res.stderr, res.stderr
    res = gpuctl_proc("down", "-y", bound=BOUND_S)
    assert res.returncode == 0, res.stderr
    assert "is down" in res.stdout and not marked(socket)
