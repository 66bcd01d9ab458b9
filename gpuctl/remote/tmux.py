"""gpuctl's tmux server on a host, and what it says of a session's pane.

A look at a pane has three answers, not two: the pane, "no such session" (tmux's own words), or
no answer (tmux failed another way, its client was killed, the connection closed under it). Only
the second proves a job gone: a run called lost on the third once had its other nodes stopped
while every node still trained (jobs.job_state).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuctl.model.untrusted import one_line
from gpuctl.remote.host import Host

MARK_VAR = "GPUCTL_TMUX"

# What tmux says when there is no such session: no socket at all, a socket nobody serves (its
# server was killed), no session of that name (tmux 3.3a's words, checked in test_jobs.py). A
# socket it may not use ("Permission denied", "unsafe permissions") is not among them.
NO_SESSION = ("can't find session", "no server running", "(No such file or directory)")


def argv(host: Host, *args: str) -> list[str]:
    """A tmux command on the cluster's own server (its socket: `tmux -L`)."""
    return ["tmux", "-L", host.tmux_socket, *args]


# What gpuctl's tmux server and every job keep of the environment they are started from: what any
# program needs to run, nothing else. Not the AWS keys or ssh agent of the `gpuctl` that started
# the server or submitted the run, not sshd's SSH_* (a job gets the rest from `train --env`).
KEEP = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM")


def clean_exec(keep: tuple[str, ...] = KEEP) -> str:
    """bash that execs "$@" under `env -i` with only the variables of `keep` that are set."""
    return (f'k=(); for v in {" ".join(keep)}; do [ -n "${{!v+x}}" ] && k+=("$v=${{!v}}"); done; '
            'exec env -i "${k[@]}" "$@"')


def server_env(host: Host) -> list[str]:
    """argv prefix for a tmux command that may start gpuctl's server: the server (and so every pane
    and every process a job starts, daemons included) starts from a clean environment (KEEP) and
    carries GPUCTL_TMUX=<socket>, which is how `down` finds them all (jobs.end_processes). The
    tmux client runs in it too: a new session takes the client's SSH_AUTH_SOCK and DISPLAY."""
    return ["bash", "-c", clean_exec(), "gpuctl-clean-env", f"{MARK_VAR}={host.tmux_socket}"]


def session_alive(host: Host, session: str) -> bool:
    return host.run(argv(host, "has-session", "-t", "=" + session), check=False).returncode == 0


@dataclass(frozen=True)
class Pane:
    pid: str
    dead: bool
    status: str  # exit status of a dead pane's process, "" if unknown or killed by a signal
    signal: str  # the signal that killed it (tmux 3.3+), else ""
    time: str  # when it died, epoch seconds by the instance's clock (tmux 3.3+), else ""


@dataclass(frozen=True)
class Unanswered:
    """A look at a pane that tmux did not answer: why, in one bounded line (the instance's words)."""

    why: str


def look_pane(host: Host, session: str) -> Pane | Unanswered | None:
    """The session's pane; None only when tmux says the session is gone; Unanswered otherwise."""
    res = host.run(argv(host, "list-panes", "-t", f"={session}:", "-F",
                        "#{pane_pid}|#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_dead_time}"),
                   check=False)
    if res.returncode == 1 and any(words in res.stderr for words in NO_SESSION):
        return None
    if res.returncode != 0 or not res.stdout.strip():  # a session tmux has lists its pane
        said = one_line(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "no output", 200)
        return Unanswered(f"tmux list-panes exited {res.returncode}: {said}")
    pid, dead, status, signal, at = (res.stdout.strip().splitlines()[0].split("|") + [""] * 4)[:5]
    return Pane(pid, dead == "1", status, signal, at)


def pane(host: Host, session: str) -> Pane | None:
    """The session's pane, or None when tmux says it is gone or did not answer: for a look that
    only shows something (TensorBoard's pane), where no answer is as good as none."""
    p = look_pane(host, session)
    return p if isinstance(p, Pane) else None


def exit_code(p: Pane) -> int | None:
    """A dead pane's exit code as tmux saw it (128 + N for signal N, as bash reports it)."""
    if p.status.isdigit():
        return int(p.status)
    if p.signal.isdigit():
        return 128 + int(p.signal)
    return None  # tmux before 3.3 keeps no signal


def capture(host: Host, session: str) -> str:
    # `=NAME:` is an exact session match (a bare name is a prefix match); -S - includes history,
    # where tmux moves the screen when the pane dies.
    res = host.run(argv(host, "capture-pane", "-p", "-S", "-", "-t", f"={session}:"), check=False)
    return res.stdout if res.returncode == 0 else ""


def kill_session(host: Host, session: str) -> None:
    host.run(argv(host, "kill-session", "-t", "=" + session), check=False)


def kill_server(host: Host) -> None:
    host.run(argv(host, "kill-server"), check=False)
