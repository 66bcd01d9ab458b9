"""No remote command without a deadline, and nothing a host does (or does not
answer) stops `down` from ending the spend. Real parts: the local provider with a `tmux` that only
sleeps placed first on gpuctl's PATH (jobs started by the real one), and sshd test hosts with the
same sleeper bind-mounted over tmux inside the host's mount namespace, or with their link down
(packets go nowhere).

Each command runs as its own process under a subprocess timeout: a hang fails the test instead of
hanging it. The bounds asserted are the ones docs/cli.md states ("Deadlines"), as correctness (the
command ended), never as speed.

Bad inputs and faults tried: tmux that never answers (status, cost, down -y, down --force -y, on
local and over SSH), a host whose packets are dropped after `up` (status, cost, guard show, pull,
down -y, down --force -y)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_ssh import up_ssh
from tests.waits import wait_for

# A command's deadline in these tests (remote.command_timeout_s, recorded at `up`): each hung
# command waits it out, so it is short; the tmux calls before the hang take milliseconds.
COMMAND_S = 2
# The bound docs/cli.md states for `down` with a host that hangs: one connection wait (5 s), one
# command deadline while stopping the jobs, one more per host while releasing and the end of its
# processes (the jobs' 3 s grace + 30 s), plus a directory move; given double, so that a loaded
# machine still finishes inside it. A hang runs into the subprocess timeout instead.
DOWN_BOUND_S = 2 * (5 + 2 * COMMAND_S + 33 + 10)
REPORT_BOUND_S = 2 * (5 + COMMAND_S + 10)

SLEEPER = "#!/bin/sh\nexec sleep 3600\n"
LONG_JOB = "import time\ntime.sleep(600)\n"


def gpuctl_proc(*args: str, bound: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """gpuctl as its own process; fails the test if it has not ended within `bound` seconds."""
    try:
        return subprocess.run([sys.executable, "-m", "gpuctl", *args], capture_output=True, text=True,
                              timeout=bound, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"gpuctl {' '.join(args)} did not end within {bound} s (it hangs): {exc.stderr!r}")


def marked(socket: str) -> list[int]:
    """This machine's processes carrying the cluster's mark (remote/jobs.py end_processes)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"GPUCTL_TMUX={socket}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
@pytest.mark.parametrize("force", [False, True])
def test_a_tmux_that_never_answers_hangs_nothing_and_down_ends_the_jobs(gpuctl, make_project, isolated, tmp_path,
                                                                         monkeypatch, force):
    from gpuctl.remote.local import LocalHost

    monkeypatch.setenv("GPUCTL_REMOTE__COMMAND_TIMEOUT_S", str(COMMAND_S))
    gpuctl("up", "--provider", "local")
    proj = make_project("long", {"train.py": LONG_JOB})
    runs = [json.loads(gpuctl("train", str(proj), "--now", "--json").stdout)["run"]["run_id"] for _ in range(2)]
    socket = LocalHost(isolated / "clusters" / "default").tmux_socket
    states = lambda: {r["run_id"]: r["state"] for r in json.loads(gpuctl("status", "--json").stdout)["runs"]}  # noqa: E731
    assert states() == {r: "running" for r in runs}
    assert marked(socket)  # the jobs run, under the cluster's tmux server
    sleeper = tmp_path / "bin" / "tmux"
    sleeper.parent.mkdir()
    sleeper.write_text(SLEEPER)
    sleeper.chmod(0o755)
    hung = {"PATH": f"{sleeper.parent}:{os.environ['PATH']}"}
    try:
        if not force:  # (the reports are the same before either down: each waits out a deadline, asked once)
            res = gpuctl_proc("cost", bound=REPORT_BOUND_S, env=hung)
            assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
            status = gpuctl_proc("status", "--json", bound=REPORT_BOUND_S, env=hung)
            assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
            assert {r["run_id"] for r in json.loads(status.stdout)["runs"]} == set(runs)
        res = gpuctl_proc("down", *(["--force"] if force else []), "-y", bound=DOWN_BOUND_S, env=hung)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        # The jobs could not be stopped through tmux: they are named, and the release ended them.
        assert "Not confirmed stopped before the release" in out and all(r in out for r in runs), out
        assert f"did not finish within {COMMAND_S} s" in out, out
        wait_for(lambda: not marked(socket), timeout=10)
    finally:
        sleeper.unlink()  # the real tmux again, for the fixture's cleanup
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"


def cluster_socket(home: Path) -> str:
    """The tmux server of the live cluster's instance (random per `up` on ssh hosts)."""
    from gpuctl.ledger import Ledger

    led = Ledger(home)
    try:
        (inst,) = led.instances(led.clusters(include_down=False)[0].id)
        return inst.tmux_socket
    finally:
        led.close()


@pytest.mark.parametrize("force", [False, True])
def test_a_tmux_that_never_answers_on_an_ssh_host_hangs_nothing(gpuctl, ssh, make_project, monkeypatch, isolated,
                                                                 force):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_REMOTE__COMMAND_TIMEOUT_S", str(COMMAND_S))
    up_ssh(gpuctl, ssh)
    proj = make_project("long", {"train.py": LONG_JOB})
    run_id = json.loads(gpuctl("train", str(proj), "--allow-cpu", "--json").stdout)["run"]["run_id"]
    socket = cluster_socket(isolated)
    assert marked(socket)  # the host's processes share this machine's process table (tests/sshd.py)
    # Inside the host's own mount namespace only: its tmux becomes a command that never answers.
    tmux = host.run("command -v tmux").stdout.strip()
    host.run(f"printf '#!/bin/sh\\nexec sleep 3600\\n' > /srv/hung-tmux && chmod 755 /srv/hung-tmux && "
             f"mount --bind /srv/hung-tmux {tmux}")
    try:
        for cmd in (["status"], ["cost"]):
            res = gpuctl_proc(*cmd, bound=REPORT_BOUND_S)
            assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        res = gpuctl_proc("down", *(["--force"] if force else []), "-y", bound=DOWN_BOUND_S)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        assert "Not confirmed stopped before the release" in out and run_id in out, out
        # The release ended every process of the cluster there without tmux (/proc, by its mark).
        wait_for(lambda: not marked(socket), timeout=10)
        assert "no process of the cluster is left" in out, out
    finally:
        host.run(f"umount {tmux}")
        for pid in host.pids(rb"^sleep 3600"):  # what the sleeper left in the host's namespace
            os.kill(pid, 9)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"


def test_a_host_whose_packets_are_dropped_costs_one_short_wait_per_command(gpuctl, ssh, make_project, tmp_path,
                                                                          monkeypatch):
    """With the link down, `guard show`, `pull` and `down` waited remote.connect_timeout_s
    (120 s by default) and `down --force` 20 s, while docs/cli.md said one 5-second wait."""
    host = ssh.hosts[0]
    # The default remote.connect_timeout_s, as a user has it (the fixture's 15 s would hide the wait).
    monkeypatch.setenv("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "120")
    up_ssh(gpuctl, ssh)
    proj = make_project("long", {"train.py": LONG_JOB})
    run_id = json.loads(gpuctl("train", str(proj), "--allow-cpu", "--json").stdout)["run"]["run_id"]
    host.unreachable()
    one_wait = 2 * (5 + 10)  # one 5 s connection wait, doubled for a loaded machine
    try:
        for cmd, code in ((["status"], 0), (["cost"], 0), (["guard", "show"], 7),
                          (["pull", run_id, "--dest", str(tmp_path / "back")], 7), (["down", "-y"], 7)):
            res = gpuctl_proc(*cmd, bound=one_wait)
            assert res.returncode == code and "Traceback" not in res.stderr, (cmd, res.stderr)
        assert "--force" in res.stderr  # down refused: the host may still run the job
        res = gpuctl_proc("down", "--force", "-y", bound=one_wait)
        assert res.returncode == 0 and "not reachable, its gpuctl jobs may still run" in res.stderr, res.stderr
        assert "Not confirmed stopped before the release" in res.stdout and run_id in res.stdout
    finally:
        host.restart()
