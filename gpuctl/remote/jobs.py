"""Jobs under tmux: one detached session per run, named after the run, on gpuctl's own tmux server.

The job's output goes to a log file and its exit code to a file written when it ends. Run state
is derived from the exit-code file and the job's pane: remain-on-exit keeps a dead pane (and its
session) after the job ends, so a session that exists proves nothing; a dead pane means the job is
over. Only when its script could not write the file (killed by a signal it cannot trap) does tmux's
pane status stand in for the code, recorded once on the instance (a pane can die with the server,
so that status is never the first source).
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuctl.errors import RemoteError, RemoteTimeout, Unconfirmed, UnreadableFile
from gpuctl.model.untrusted import EARLIEST, LATEST, N, number
from gpuctl.payloads.gpuctl_protocol import EXIT_CODE_FILE, NODE_STARTED_FILE, STOP_FILE
from gpuctl.remote import tmux
from gpuctl.remote.host import COMMAND_TIMEOUT_S, Host
from gpuctl.retry import REAL_CLOCK, Backoff, Clock

LOG = "output.log"
EPOCHS = "epochs.jsonl"
# The instance's clock at the job's start and end: how long it ran, whatever the client's clock says.
STARTED = "started"
ENDED = "ended"
SCRIPT = "job.sh"
# The job's environment to start from (tmux.KEEP) and tmux's own marks: `down` finds its processes by them.
JOB_KEEP = (*tmux.KEEP, tmux.MARK_VAR, "TMUX", "TMUX_PANE")


@dataclass(frozen=True)
class JobPaths:
    run_dir: str

    @property
    def log(self) -> str:
        return posixpath.join(self.run_dir, LOG)

    @property
    def exitcode(self) -> str:
        return posixpath.join(self.run_dir, EXIT_CODE_FILE)

    @property
    def started(self) -> str:
        return posixpath.join(self.run_dir, STARTED)

    @property
    def ended(self) -> str:
        return posixpath.join(self.run_dir, ENDED)

    @property
    def node_started(self) -> str:
        return posixpath.join(self.run_dir, NODE_STARTED_FILE)

    @property
    def stop_requested(self) -> str:
        return posixpath.join(self.run_dir, STOP_FILE)

    @property
    def epochs(self) -> str:
        return posixpath.join(self.run_dir, EPOCHS)

    @property
    def script(self) -> str:
        return posixpath.join(self.run_dir, SCRIPT)

    @property
    def outputs(self) -> str:
        return posixpath.join(self.run_dir, "outputs")

    @property
    def secrets(self) -> str:
        """`train --env` values: read by the job's script at its start, then deleted."""
        return posixpath.join(self.run_dir, ".secrets.env")


def job_script(workdir: str, command: Sequence[str], env: Mapping[str, str], paths: JobPaths) -> str:
    """The bash script tmux runs: every value in it is shlex-quoted."""
    q = shlex.quote
    tmp = paths.exitcode + ".tmp"
    lines = [
        "#!/usr/bin/env bash",
        "# Written by gpuctl: runs one job, tees its output to the log, records its exit code.",
        # Again under a clean environment, whoever started the tmux server (an older gpuctl's
        # server kept its caller's): the job sees only what gpuctl sets below and `--env` names.
        f'if [ "${{1:-}}" != --clean ]; then set -- bash "$0" --clean; {tmux.clean_exec(JOB_KEEP)}; fi',
        # A trap (not an ignore, which children would inherit) lets the job be stopped with
        # SIGTERM, or Ctrl-C in `gpuctl attach` (SIGINT to the pane's process group), while this
        # script lives on to record the job's exit code (130 for a job ended by Ctrl-C).
        "trap 'true' TERM HUP INT",
        # The end time is written before the exit code: once the code exists, so does the time.
        # GNU date gives nanoseconds; BusyBox and BSD date print a literal N: seconds do there.
        "now() { t=$(date +%s.%N); case $t in *N*) date +%s ;; *) echo \"$t\" ;; esac; }",
        f"finish() {{ now > {q(paths.ended)}; echo \"$1\" > {q(tmp)} && mv -f {q(tmp)} {q(paths.exitcode)}; "
        "exit \"$1\"; }",
        # `train --env` values live in a file of the owner's alone until here, whatever happens next.
        f"if [ -f {q(paths.secrets)} ]; then . {q(paths.secrets)}; rm -f {q(paths.secrets)}; fi",
        f"now > {q(paths.started)}",
        f"mkdir -p {q(paths.outputs)}",
        f"cd {q(workdir)} || finish 127",
    ]
    lines += [f"export {k}={q(v)}" for k, v in env.items()]
    lines += [
        # tee ignores TERM and INT: a job stopped gracefully (or by Ctrl-C) can still print while
        # it checkpoints or shows its traceback; tee ends when the job closes the pipe.
        f"{shlex.join(command)} 2>&1 | (trap '' TERM INT; exec tee -a {q(paths.log)})",
        "finish \"${PIPESTATUS[0]}\"",
    ]
    return "\n".join(lines) + "\n"


def start_detached(host: Host, argv: Sequence[str], what: str) -> int:
    """Start `argv` on the host in the background, apart from this SSH session (a closed laptop
    does not stop it); its pid. It carries the cluster's process mark, so `down` ends it."""
    script = (f"cd / && {tmux.MARK_VAR}={shlex.quote(host.tmux_socket)} setsid nohup {shlex.join(argv)} "
              "</dev/null >/dev/null 2>&1 & echo $!")
    res = host.run(["sh", "-c", script], timeout=60)
    try:
        return int(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(f"could not start {what} on {host.label}: {res.stderr.strip()[-300:]}") from None


def start_job(host: Host, session: str, workdir: str, command: Sequence[str], env: Mapping[str, str], paths: JobPaths,
              secret_env: Mapping[str, str] | None = None) -> None:
    """Start `command` in a detached tmux session; returns once tmux has it. `secret_env` reaches
    the job without being written into its script (train --env)."""
    if secret_env:
        private_dir(host, paths.run_dir)  # first: the file is written before its chmod
        _write_secrets(host, paths, secret_env)
    host.write_text(paths.script, job_script(workdir, command, env, paths), mode=0o700)
    _new_session(host, session, paths)


def private_dir(host: Host, path: str) -> None:
    """`path` made (if need be) and the owner's alone, for files written there before their chmod."""
    host.run(["sh", "-c", 'mkdir -p "$1" && chmod 700 "$1"', "sh", path])


def restart_job(host: Host, session: str, paths: JobPaths, secret_env: Mapping[str, str] | None = None) -> None:
    """Run a job's own script again (train --resume): same command and environment, the same log
    (appended to); its old end marks and its dead pane go first."""
    clear_ends(host, session, paths)
    if secret_env:
        _write_secrets(host, paths, secret_env)
    _new_session(host, session, paths)


def clear_ends(host: Host, session: str, paths: JobPaths) -> None:
    """Forget how a job ended (its dead pane, its exit code and end time) before it runs again."""
    tmux.kill_session(host, session)
    host.run(["rm", "-f", paths.exitcode, paths.ended, paths.node_started, paths.stop_requested])


def _write_secrets(host: Host, paths: JobPaths, secret_env: Mapping[str, str]) -> None:
    """The job script sources this file (the owner's alone) and deletes it."""
    host.write_text(paths.secrets, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in secret_env.items()),
                    mode=0o600)


def _new_session(host: Host, session: str, paths: JobPaths) -> None:
    host.run(
        tmux.server_env(host) + tmux.argv(host, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", shlex.join(["bash", paths.script]))
        # remain-on-exit keeps the pane for `capture-pane`/attach after the job ends.
        + [";", "set-option", "-t", session, "remain-on-exit", "on"]
    )


def record_exit_from_pane(host: Host, paths: JobPaths, p: tmux.Pane) -> int | None:
    """For a dead pane whose script wrote no exit code: write tmux's code (and the end time) on
    the instance, once, so every reader (this client, the watchdog, a later `status`) agrees.
    None when tmux does not know it either; the run is over all the same."""
    code = tmux.exit_code(p)
    if code is None:
        return None
    q = shlex.quote
    tmp = paths.exitcode + ".pane.tmp"
    when = q(p.time) if p.time.isdigit() else "$(date +%s)"  # the instance's clock, like the script's
    script = (f"[ -e {q(paths.exitcode)} ] && exit 0; [ -e {q(paths.ended)} ] || echo {when} > {q(paths.ended)}; "
              f"echo {code} > {q(tmp)} && mv -f {q(tmp)} {q(paths.exitcode)}")
    host.run(["sh", "-c", script], check=False)
    return read_exit_code(host, paths)


def read_exit_code(host: Host, paths: JobPaths) -> int | None:
    """The job's exit code, if its file holds a believable one (a shell's: -1024..1024)."""
    return _number(host, paths.exitcode, int, -1024, 1024)


def _number(host: Host, path: str, kind: type[N], low: float, high: float) -> N | None:
    """A number the instance wrote into a small file; None when absent, not a number, out of
    bounds, or not readable as a file (a link loop the job made: it must not hold `stop` or `down`)."""
    try:
        return number(host.read_bytes(path, 0, 64), kind, low, high)
    except UnreadableFile:
        return None


def _instant(host: Host, path: str) -> float | None:
    """A time on the instance's clock (`started`, `ended`): finite and within 2000..2100, else None."""
    return _number(host, path, float, EARLIEST, LATEST)


def started_at(host: Host, paths: JobPaths) -> float | None:
    """When the job (last) started, by the instance's clock; None if unknown."""
    return _instant(host, paths.started)


def ended_at(host: Host, paths: JobPaths) -> float | None:
    """When the job ended, by the instance's clock; None while it runs (or if unknown)."""
    return _instant(host, paths.ended)


def duration(host: Host, paths: JobPaths) -> float | None:
    """How long the job ran, by the instance's clock; None until it has ended (or if unknown)."""
    start, end = _instant(host, paths.started), _instant(host, paths.ended)
    return max(0.0, end - start) if start is not None and end is not None else None


REAP_WAIT_S = 3.0  # how long tmux may take to learn a dead pane's exit status
REAP_PAUSE_S = 0.2  # between looks at it


def job_state(host: Host, session: str, paths: JobPaths, record: bool = True,
              clock: Clock = REAL_CLOCK) -> tuple[str, int | None]:
    """('running' | 'succeeded' | 'failed' | 'lost', exit code or None). A dead pane whose code
    nobody knows is 'failed' with None: over, not running. Lost only on tmux's word that the
    session is gone: a look tmux did not answer says 'running', the one state that ends nothing
    (the next look, or the exit code once written, decides). `record` False (a look): tmux's code
    of a dead pane is read, not written on the instance (its watchdog writes it at its next tick)."""
    p = tmux.look_pane(host, session)  # looked at first: a pane dead now has written its code (if it could)
    code = read_exit_code(host, paths)
    if isinstance(p, tmux.Unanswered):
        return _by_code(code) if code is not None else ("running", None)
    if code is None and p is not None and p.dead:
        # tmux marks a pane dead when its terminal closes, and learns the status a moment later when
        # it reaps the process: give it that moment before calling the code unknown (on a loaded
        # machine 1 s was once too short). Some never come: tmux 3.3a loses about one killed
        # pane's status in 30, and a tmux before 3.3 keeps no signal; those cost the whole wait.
        reap = Backoff(REAP_PAUSE_S, timeout_s=REAP_WAIT_S, clock=clock)
        while tmux.exit_code(p) is None and not reap.expired():
            reap.pause()
            p = tmux.pane(host, session) or p
        code = record_exit_from_pane(host, paths, p) if record else tmux.exit_code(p)
        if code is None:
            return "failed", None
    if code is not None:
        return _by_code(code)
    return ("running" if p is not None else "lost"), None


def _by_code(code: int) -> tuple[str, int]:
    return ("succeeded" if code == 0 else "failed"), code


# How long a stopped job has to save and exit after SIGTERM before SIGKILL (down, gpuctl stop).
STOP_GRACE_S = 10.0
STOP_LOOKS = 3  # looks at a pane that tmux does not answer before a stop gives up on it
LOOK_PAUSE_S = 0.5  # between them


def _pane_to_stop(host: Host, session: str, paths: JobPaths, clock: Clock) -> tmux.Pane | None:
    """The job's pane, asked again while tmux does not answer (a blip); None once its exit code is
    there (it is over); Unconfirmed when tmux never answers: without the pane's process group
    nothing can be signalled, and the job may run on."""
    pauses = Backoff(LOOK_PAUSE_S, clock=clock)
    why = ""
    for look in range(STOP_LOOKS):
        p = tmux.look_pane(host, session)
        if not isinstance(p, tmux.Unanswered):
            return p
        why = p.why
        if read_exit_code(host, paths) is not None:
            return None
        if look + 1 < STOP_LOOKS:
            pauses.pause()
    raise Unconfirmed(f"could not stop {session} on {host.label}: {why}",
                      "`gpuctl down` ends it anyway, with every process of the cluster there (without tmux).")


# A stopped job's pane is looked at soon (most jobs are gone within tens of ms), then every 0.2 s.
STOP_FIRST_LOOK_S, STOP_LOOK_S = 0.02, 0.2
KILL_SEEN_S = 0.2  # for tmux to see a SIGKILLed pane die


def stop_job(host: Host, session: str, paths: JobPaths, grace_s: float = STOP_GRACE_S,
             clock: Clock = REAL_CLOCK) -> int | None:
    """SIGTERM the job's process group, SIGKILL it after `grace_s` (on `clock`), then drop the session."""
    p = _pane_to_stop(host, session, paths, clock)
    if p is not None:
        if p.pid and not p.dead:
            try:
                host.write_text(paths.stop_requested, "", mode=0o600)  # before the SIGTERM: see STOP_FILE
            except RemoteTimeout:
                raise
            except RemoteError:
                pass  # a run dir that cannot take it (a hostile instance): the SIGTERM and SIGKILL still go
            # tmux starts each pane as a session leader: its pid is the job's process group.
            host.run(["kill", "-TERM", "--", "-" + p.pid], check=False)
            grace = Backoff(STOP_FIRST_LOOK_S, STOP_LOOK_S, grace_s, clock)
            while not grace.expired() and read_exit_code(host, paths) is None:
                now = tmux.look_pane(host, session)  # no answer is no end: the job may still be saving
                if now is None or (isinstance(now, tmux.Pane) and now.dead):
                    break  # gone without an exit code (killed before its wrapper could write one)
                grace.pause()
            if read_exit_code(host, paths) is None:
                host.run(["kill", "-KILL", "--", "-" + p.pid], check=False)
                clock.sleep(KILL_SEEN_S)
                p = tmux.pane(host, session)
        if p is not None and p.dead and read_exit_code(host, paths) is None:
            record_exit_from_pane(host, paths, p)  # before the session, and tmux's word, are gone
        tmux.kill_session(host, session)
    return read_exit_code(host, paths)


# Every process of this host's user that carries the cluster's mark: set at the server's start
# (server_env), or tmux's own TMUX=<socket path>,<pid>,<n> in a pane that a server without the mark
# started. Reads /proc (Linux: the instances, the test hosts); other users' processes are unreadable
# and so never matched. Prints what is left after SIGTERM, a wait and SIGKILL; exits 1 if anything is.
# One grep reads every environ (-l: to its first match; -s: a process that is gone or not this
# user's says nothing): a grep per process cost a fork and exec for each of the machine's hundreds,
# ten looks a second through the grace. The names go through xargs (printf is the shell's own), so
# no number of processes is too long a command line. The script runs without the mark
# (end_processes), so that neither it nor its subshells, xargs or grep are among what it finds.
_END_PROCESSES = r'''
sock=$1; grace=$2
pids() {
  printf '%s\n' /proc/[0-9]*/environ |
    xargs grep -lszxE "(GPUCTL_TMUX=$sock|TMUX=.*/$sock,[0-9]+,[0-9]+)" |
    while IFS=/ read -r _ _ p _; do echo "$p"; done
}
p=$(pids); [ -z "$p" ] && exit 0
kill -TERM $p 2>/dev/null
n=0; while [ $n -lt $((grace * 10)) ]; do sleep 0.1; p=$(pids); [ -z "$p" ] && exit 0; n=$((n + 1)); done
kill -KILL $p 2>/dev/null; sleep 0.5
p=$(pids); [ -z "$p" ] && exit 0
for q in $p; do printf '%s %s
' "$q" "$(tr '\0' ' ' < /proc/$q/cmdline 2>/dev/null | cut -c1-80)"; done
exit 1
'''


def end_processes(host: Host, grace_s: int = 3) -> list[str]:
    """End every process of the cluster's tmux server on the host (jobs, their children and daemons,
    TensorBoard, the watchdog's loop, the server itself): SIGTERM, `grace_s`, SIGKILL, then look
    again. The processes still there ("pid command"); [] when none is."""
    if not all(c.isalnum() or c in "-_" for c in host.tmux_socket):
        raise ValueError(f"unexpected tmux socket name {host.tmux_socket!r}")  # it goes into a regex
    # Its own deadline: the grace it waits, and a look through /proc that a busy machine makes slow.
    res = host.run(["env", "-u", tmux.MARK_VAR, "-u", "TMUX", "sh", "-c", _END_PROCESSES, "end-processes",
                    host.tmux_socket, str(int(grace_s))], check=False,
                   timeout=grace_s + COMMAND_TIMEOUT_S)
    return [line for line in res.stdout.splitlines() if line.strip()] if res.returncode else []


def tail_text(host: Host, path: str, lines: int = 20) -> str:
    data = host.read_bytes(path, -(64 << 10)) or b""  # the end of the file only
    return "\n".join(data.decode("utf-8", "replace").rstrip("\n").splitlines()[-lines:])
