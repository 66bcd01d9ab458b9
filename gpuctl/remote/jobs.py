"""Jobs under tmux: one detached session per run, named after the run, on gpuctl's own tmux server.

The job's output goes to a log file and its exit code to a file written when it ends; the code
never trusts tmux's pane status (a pane can die with the server). Run state is derived from two
facts: does the exit-code file exist, and does the session still exist.
"""

from __future__ import annotations

import posixpath
import shlex
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuctl.remote.host import Host

LOG = "output.log"
EXITCODE = "exitcode"
EPOCHS = "epochs.jsonl"
# The instance's clock at the job's start and end: how long it ran, whatever the client's clock says.
STARTED = "started"
ENDED = "ended"
SCRIPT = "job.sh"


@dataclass(frozen=True)
class JobPaths:
    run_dir: str

    @property
    def log(self) -> str:
        return posixpath.join(self.run_dir, LOG)

    @property
    def exitcode(self) -> str:
        return posixpath.join(self.run_dir, EXITCODE)

    @property
    def started(self) -> str:
        return posixpath.join(self.run_dir, STARTED)

    @property
    def ended(self) -> str:
        return posixpath.join(self.run_dir, ENDED)

    @property
    def epochs(self) -> str:
        return posixpath.join(self.run_dir, EPOCHS)

    @property
    def script(self) -> str:
        return posixpath.join(self.run_dir, SCRIPT)

    @property
    def outputs(self) -> str:
        return posixpath.join(self.run_dir, "outputs")


def job_script(workdir: str, command: Sequence[str], env: Mapping[str, str], paths: JobPaths) -> str:
    """The bash script tmux runs: every value in it is shlex-quoted."""
    q = shlex.quote
    tmp = paths.exitcode + ".tmp"
    lines = [
        "#!/usr/bin/env bash",
        "# Written by gpuctl: runs one job, tees its output to the log, records its exit code.",
        # A trap (not an ignore, which children would inherit) lets the job be stopped with
        # SIGTERM while this script lives on to record the job's exit code.
        "trap 'true' TERM HUP",
        # The end time is written before the exit code: once the code exists, so does the time.
        # GNU date gives nanoseconds; BusyBox and BSD date print a literal N: seconds do there.
        "now() { t=$(date +%s.%N); case $t in *N*) date +%s ;; *) echo \"$t\" ;; esac; }",
        f"finish() {{ now > {q(paths.ended)}; echo \"$1\" > {q(tmp)} && mv -f {q(tmp)} {q(paths.exitcode)}; "
        "exit \"$1\"; }",
        f"now > {q(paths.started)}",
        f"mkdir -p {q(paths.outputs)}",
        f"cd {q(workdir)} || finish 127",
    ]
    lines += [f"export {k}={q(v)}" for k, v in env.items()]
    lines += [
        # tee ignores TERM: a job stopped gracefully can still print while it checkpoints.
        f"{shlex.join(command)} 2>&1 | (trap '' TERM; exec tee -a {q(paths.log)})",
        "finish \"${PIPESTATUS[0]}\"",
    ]
    return "\n".join(lines) + "\n"


def _tmux(host: Host, *args: str) -> list[str]:
    return ["tmux", "-L", host.tmux_socket, *args]


def start_job(host: Host, session: str, workdir: str, command: Sequence[str], env: Mapping[str, str], paths: JobPaths) -> None:
    """Start `command` in a detached tmux session; returns once tmux has it."""
    host.write_text(paths.script, job_script(workdir, command, env, paths), mode=0o700)
    host.run(
        _tmux(host, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", shlex.join(["bash", paths.script]))
        # remain-on-exit keeps the pane for `capture-pane`/attach after the job ends.
        + [";", "set-option", "-t", session, "remain-on-exit", "on"]
    )


def session_alive(host: Host, session: str) -> bool:
    return host.run(_tmux(host, "has-session", "-t", "=" + session), check=False).returncode == 0


def read_exit_code(host: Host, paths: JobPaths) -> int | None:
    data = host.read_bytes(paths.exitcode)
    if data is None:
        return None
    try:
        return int(data.decode().strip())
    except ValueError:
        return None


def _instant(host: Host, path: str) -> float | None:
    try:
        return float((host.read_bytes(path) or b"").decode().strip())
    except ValueError:
        return None


def duration(host: Host, paths: JobPaths) -> float | None:
    """How long the job ran, by the instance's clock; None until it has ended (or if unknown)."""
    start, end = _instant(host, paths.started), _instant(host, paths.ended)
    return max(0.0, end - start) if start is not None and end is not None else None


def job_state(host: Host, session: str, paths: JobPaths) -> tuple[str, int | None]:
    """('running' | 'succeeded' | 'failed' | 'lost', exit code or None)."""
    alive = session_alive(host, session)  # checked first: a job ending now has written its code
    code = read_exit_code(host, paths)
    if code is not None:
        return ("succeeded" if code == 0 else "failed"), code
    return ("running" if alive else "lost"), None


def capture_pane(host: Host, session: str) -> str:
    # `=NAME:` is an exact session match (a bare name is a prefix match); -S - includes history,
    # where tmux moves the screen when the pane dies.
    res = host.run(_tmux(host, "capture-pane", "-p", "-S", "-", "-t", f"={session}:"), check=False)
    return res.stdout if res.returncode == 0 else ""


def stop_job(host: Host, session: str, paths: JobPaths, grace_s: float = 10.0) -> int | None:
    """SIGTERM the job's process group, SIGKILL it after `grace_s`, then drop the session."""
    res = host.run(_tmux(host, "list-panes", "-t", f"={session}:", "-F", "#{pane_pid} #{pane_dead}"), check=False)
    if res.returncode == 0:
        pid, _, dead = res.stdout.strip().partition(" ")
        if pid and dead.strip() != "1":
            # tmux starts each pane as a session leader: its pid is the job's process group.
            host.run(["kill", "-TERM", "--", "-" + pid], check=False)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and read_exit_code(host, paths) is None:
                time.sleep(0.2)
            if read_exit_code(host, paths) is None:
                host.run(["kill", "-KILL", "--", "-" + pid], check=False)
        host.run(_tmux(host, "kill-session", "-t", "=" + session), check=False)
    return read_exit_code(host, paths)


def kill_server(host: Host) -> None:
    host.run(_tmux(host, "kill-server"), check=False)


def tail_text(host: Host, path: str, lines: int = 20) -> str:
    data = host.read_bytes(path) or b""
    return "\n".join(data.decode("utf-8", "replace").rstrip("\n").splitlines()[-lines:])
