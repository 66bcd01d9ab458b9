"""Jobs under a real tmux server: started, followed, exit codes read, stopped, quoted."""

import shlex
import sys
import time
from pathlib import Path

import pytest

from gpuctl.remote import jobs, tmux
from gpuctl.remote.local import LocalHost
from tests.waits import FakeClock, wait_for


@pytest.fixture
def host(tmp_path):
    h = LocalHost(tmp_path / "root")
    (tmp_path / "root").mkdir()
    yield h
    tmux.kill_server(h)


def wait_final(host, session, paths, timeout=30):
    def final():
        state, code = jobs.job_state(host, session, paths)
        return (state, code) if state != "running" else None

    return wait_for(final, timeout, "the job's end")


def test_job_runs_logs_and_records_exit_code(host, tmp_path):
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "r1"))
    script = "import sys, time; print('hello', flush=True); time.sleep(1); print('bye'); sys.exit(3)"
    jobs.start_job(host, "r1", host.root, [sys.executable, "-c", script], {"GPUCTL_RUN_ID": "r1"}, paths)
    assert jobs.job_state(host, "r1", paths) == ("running", None)
    assert tmux.session_alive(host, "r1")
    # Follow the log while it grows.
    seen = [""]

    def read_on() -> bool:
        seen[0] += (host.read_bytes(paths.log, len(seen[0].encode())) or b"").decode()
        return "bye" in seen[0]

    wait_for(read_on, 20, "the log's last line")
    assert seen[0].splitlines() == ["hello", "bye"]
    assert wait_final(host, "r1", paths) == ("failed", 3)
    # remain-on-exit keeps the pane for capture-pane after the job ended.
    assert "bye" in tmux.capture(host, "r1")


def test_success_and_lost(host, tmp_path):
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "ok"))
    jobs.start_job(host, "ok", host.root, ["true"], {}, paths)
    assert wait_final(host, "ok", paths) == ("succeeded", 0)
    ghost = jobs.JobPaths(str(tmp_path / "root" / "runs" / "ghost"))
    assert jobs.job_state(host, "ghost", ghost) == ("lost", None)  # tmux: "can't find session"
    # No tmux server at all (the machine rebooted), and a socket whose server was SIGKILLed: real
    # tmux's words for each, each a lost job.
    (tmp_path / "other").mkdir()
    other = LocalHost(tmp_path / "other")
    assert "(No such file or directory)" in said_by_tmux(other)
    assert jobs.job_state(other, "ghost", ghost) == ("lost", None)
    other.run(tmux.argv(other, "new-session", "-d", "-s", "x", "sleep 300"))
    server, sleeper = other.run(tmux.argv(other, "list-panes", "-t", "=x:", "-F", "#{pid} #{pane_pid}")).stdout.split()
    other.run(["kill", "-KILL", server, sleeper])
    # until it is gone: a client that reached it dying says "server exited unexpectedly"
    wait_for(lambda: not Path(f"/proc/{server}").exists(), 10, "the killed tmux server gone")
    assert "no server running" in said_by_tmux(other)
    assert jobs.job_state(other, "ghost", ghost) == ("lost", None)


def said_by_tmux(host) -> str:
    return host.run(tmux.argv(host, "list-panes", "-t", "=ghost:"), check=False).stderr


def test_stop_job_terminates_the_process_group_and_records_the_code(host, tmp_path):
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "s"))
    jobs.start_job(host, "s", host.root, ["bash", "-c", "sleep 300 & wait"], {}, paths)
    wait_for(lambda: host.read_bytes(paths.started), 10, "the job's start")  # its traps are set by then
    code = jobs.stop_job(host, "s", paths, grace_s=5)
    assert code is not None and code != 0
    assert not tmux.session_alive(host, "s")
    assert jobs.job_state(host, "s", paths)[0] == "failed"


def wait_log(host, paths, needle, timeout=20):
    wait_for(lambda: needle in (host.read_bytes(paths.log) or b"").decode(), timeout, f"{needle!r} in the log")


def test_a_job_deaf_to_sigterm_gets_the_whole_grace_on_the_clock_then_sigkill(host, tmp_path):
    """The grace is grace_s of the stop's clock: looked at after 0.02 s, doubling to every 0.2 s
    until it is over, then SIGKILL; a driven clock makes its 10 s take none."""
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "deaf"))
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    jobs.start_job(host, "deaf", host.root, [sys.executable, "-c", deaf], {}, paths)
    wait_log(host, paths, "up")
    clock = FakeClock()
    jobs.stop_job(host, "deaf", paths, grace_s=10, clock=clock)  # its code: tmux's, which needs real time
    assert not tmux.session_alive(host, "deaf")
    *grace, seen = clock.slept  # the last pause is the one after SIGKILL
    assert grace[:5] == [0.02, 0.04, 0.08, 0.16, 0.2] and set(grace[5:]) == {0.2}
    assert 10 <= sum(grace) < 10.2 and seen == jobs.KILL_SEEN_S


def test_ctrl_c_in_the_pane_ends_the_job_with_130(host, tmp_path):
    """Ctrl-C in `gpuctl attach` is SIGINT to the pane's whole process group: the script records
    the code (it traps INT), tee outlives it (the traceback reaches the log), and the run is over.
    Before: the script died with the job, the dead pane was kept, and the run was "running" forever."""
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "c"))
    jobs.start_job(host, "c", host.root, [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                   {}, paths)
    wait_log(host, paths, "up")
    host.run(["tmux", "-L", host.tmux_socket, "send-keys", "-t", "=c:", "C-c"])
    assert wait_final(host, "c", paths, timeout=10) == ("failed", 130)
    assert host.read_bytes(paths.exitcode) == b"130\n"  # written by the script itself
    assert "KeyboardInterrupt" in host.read_bytes(paths.log).decode()
    assert jobs.duration(host, paths) is not None


@pytest.mark.parametrize("signal, code", [("KILL", 137), ("QUIT", 131)])
def test_a_dead_pane_without_an_exit_code_is_over_with_tmuxs_code(host, tmp_path, signal, code):
    """The script itself killed (SIGKILL to the group, or Ctrl-\\): nothing wrote the exit code.
    The dead pane ends the run, and tmux's status is recorded once, as the fallback. (tmux 3.3a
    loses about one killed pane's status in 30 for good: the run is then over with no code, and
    the kill is tried again, so that the recording is what is tested.)"""
    for attempt in range(3):
        session = f"k{attempt}"
        paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / session))
        jobs.start_job(host, session, host.root, ["bash", "-c", "echo up; sleep 300"], {}, paths)
        wait_log(host, paths, "up")
        p = tmux.pane(host, session)
        assert p is not None and not p.dead
        host.run(["kill", f"-{signal}", "--", f"-{p.pid}"])
        final = wait_final(host, session, paths, timeout=10)
        if final == ("failed", None):  # tmux never learnt it: over all the same, nothing recorded
            assert host.read_bytes(paths.exitcode) is None
            # ... and it really never does: had it come later, job_state gave up too early.
            late = time.monotonic() + 5
            while time.monotonic() < late:
                p = tmux.pane(host, session)
                assert p is not None and tmux.exit_code(p) is None, "job_state gave up before tmux reaped"
                time.sleep(0.5)
            continue
        break
    assert final == ("failed", code)
    assert host.read_bytes(paths.exitcode) == f"{code}\n".encode()  # recorded for every reader
    assert jobs.duration(host, paths) is not None  # and its end, by the instance's clock
    assert jobs.stop_job(host, session, paths) == code  # stopping an ended job changes nothing
    assert not tmux.session_alive(host, session)


NASTY = ["sp ace", "quo'te", 'dq"x', "$(touch pwned1)", "`touch pwned2`", "; touch pwned3", "ünï©ødé", "*"]


def test_arguments_env_and_paths_are_never_shell(host, tmp_path):
    workdir = tmp_path / "root" / "dir with 'quote' $(x)"
    workdir.mkdir()
    paths = jobs.JobPaths(str(tmp_path / "root" / "runs" / "q"))
    code = "import os, sys; print(repr(sys.argv[1:])); print(repr(os.environ['WEIRD'])); print(os.getcwd())"
    jobs.start_job(host, "q", str(workdir), [sys.executable, "-c", code, *NASTY], {"WEIRD": "$(touch pwned4) 'x'"}, paths)
    assert wait_final(host, "q", paths) == ("succeeded", 0)
    out = host.read_bytes(paths.log).decode().splitlines()
    assert out[0] == repr(NASTY)
    assert out[1] == repr("$(touch pwned4) 'x'")
    assert out[2] == str(workdir)
    assert not list(tmp_path.rglob("pwned*"))
    assert "shlex" and shlex.quote("$(x)") in jobs.job_script(str(workdir), ["echo", "$(x)"], {}, paths)


def test_end_processes_ends_what_carries_the_mark_and_nothing_else(host, tmp_path):
    """`down`'s end of a cluster's processes (one grep over /proc/*/environ): a process with the
    cluster's mark, one in a pane of a server without it (tmux's TMUX=<socket path>,pid,n), one
    that ignores SIGTERM (it gets SIGKILL after the grace); not a neighbour cluster's. Nothing is
    reported left over: the script itself, its subshells and its grep are not among what it finds."""
    import os
    import subprocess

    mine, other = host.tmux_socket, host.tmux_socket + "x"
    sleeper = [sys.executable, "-c", "import signal, sys, time\n"
               "if sys.argv[1:] == ['deaf']: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "print('ready', flush=True); time.sleep(120)"]

    def started(env: dict[str, str], *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen([*sleeper, *extra], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"  # its handler is set before the end comes
        return proc

    marked = started({tmux.MARK_VAR: mine})
    in_pane = started({"TMUX": f"/tmp/tmux-0/{mine},123,0"})
    deaf = started({tmux.MARK_VAR: mine}, "deaf")
    neighbour = started({tmux.MARK_VAR: other})
    try:
        assert jobs.end_processes(host, grace_s=1) == []
        assert marked.wait(timeout=10) == -15 and in_pane.wait(timeout=10) == -15
        assert deaf.wait(timeout=10) == -9
        assert neighbour.poll() is None
    finally:
        for proc in (marked, in_pane, deaf, neighbour):
            proc.kill()
            proc.wait()
