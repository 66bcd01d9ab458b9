"""Host: run commands and move files on an instance, the same way whether it is this machine
(local.py's LocalHost) or one reached over SSH (ssh/host.py's SshHost), as Fabric's Connection
mirrors Invoke's Context. This module is the contract both keep, and what they share.

Commands are argv lists, never shell strings: the local host passes them to exec directly and a
remote host joins them with shlex.quote, so no user-controlled string reaches a shell unquoted.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from gpuctl.errors import RemoteError, RemoteTimeout
from gpuctl.model.endpoint import Endpoint
from gpuctl.model.records import CommandResult, SyncStats
from gpuctl.model.untrusted import MAX_READ

# Every command on a host has a deadline: this, unless the caller names its own (remote.command_timeout_s).
COMMAND_TIMEOUT_S = 30.0
# How long a first connection may take where gpuctl only reports or ends (status, cost, logs,
# guard show, pull, down): a host that does not answer then costs one wait this long, not
# the minutes a booting instance is given (remote.connect_timeout_s).
QUICK_CONNECT_S = 5.0
# Deleting a run's tree (checkpoints of many GB) may take longer than a command.
REMOVE_TIMEOUT_S = 600.0
# The user's own command (`gpuctl exec`) runs as long as it runs: Ctrl-C ends it.
NO_DEADLINE = math.inf
# What one command's stdout, and its stderr, may bring back: the last this many bytes; the rest is
# read, discarded and counted (CommandResult.dropped), so memory stays flat whatever the instance
# prints (a shell start-up file, an nvidia-smi gone mad). A caller that needs more names its own.
MAX_OUTPUT = 1 << 20
HUNG_HINT = ("The host answers but its commands hang (a stuck tmux, a full disk, a network that stopped): `gpuctl "
             "status` answers from the ledger; `gpuctl down -y` still releases the cluster.")


class Deadlines:
    """The deadline rule LocalHost and SshHost share: every command gets one (the host's
    `command_timeout_s` unless the caller names another), and a host that ran past one is not
    asked again in this gpuctl command (every later call fails at once with the same error), so a
    hung host costs a command one wait, not one per run or per file."""

    label: str
    command_timeout_s: float = COMMAND_TIMEOUT_S
    hung: RemoteTimeout | None = None

    def deadline(self, timeout: float | None = None) -> float | None:
        """The seconds a call may take (None: no limit); a host that hung already fails here."""
        if self.hung is not None:
            raise self.hung
        limit = self.command_timeout_s if timeout is None else timeout
        return None if math.isinf(limit) else limit

    def timed_out(self, what: str, seconds: float) -> RemoteTimeout:
        """The error for a call past its deadline; the host counts as hung from now on."""
        self.hung = RemoteTimeout(f"{what} did not finish within {seconds:g} s on {self.label}", HUNG_HINT)
        return self.hung


class Tail:
    """The last `limit` bytes of a stream (None: all of it), and how many before them were dropped.
    Holds at most twice `limit` at any moment."""

    def __init__(self, limit: int | None = MAX_OUTPUT):
        self.limit, self.buf, self.dropped = limit, bytearray(), 0

    def add(self, data: bytes) -> None:
        self.buf += data
        if self.limit is not None and len(self.buf) > 2 * self.limit:
            self._trim()

    def _trim(self) -> None:
        cut = len(self.buf) - (self.limit or 0)
        if self.limit is not None and cut > 0:
            del self.buf[:cut]
            self.dropped += cut

    def text(self) -> str:
        self._trim()
        return self.buf.decode("utf-8", "replace")


def shown(argv: Sequence[str]) -> str:
    """How an error names a command: its first words."""
    return f"`{' '.join(argv[:3])}{' ...' if len(argv) > 3 else ''}`"


class Host(Protocol):
    root: str  # gpuctl's working directory on the host (code, runs, payload live below it)
    tmux_socket: str  # name of gpuctl's own tmux server there (`tmux -L`), apart from the user's
    label: str  # how errors name this host
    python: str  # the interpreter that runs the payload unless `remote.python` says otherwise
    local: bool  # True: this machine itself (nothing to check first, nothing to forward)

    command_timeout_s: float  # the deadline of a command that names none (Deadlines)

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None,
            cwd: bool = True, output_limit: int | None = MAX_OUTPUT, probe: bool = False) -> CommandResult:
        """Run argv on the host; with check, a non-zero exit raises RemoteError. `timeout`: seconds
        (None: the host's command_timeout_s; NO_DEADLINE for the user's own command); past it,
        RemoteTimeout, and the host is not asked again in this gpuctl command. `cwd`: in `root`
        (False: where a login starts, for a root not made yet). Of each stream only the last
        `output_limit` bytes are kept (None: all; `dropped` counts the rest). `probe`: a command
        whose hanging says nothing of the host (nvidia-smi): past `timeout` it is ended and
        answers exit 124 (as `timeout` does), and the host is asked again."""

    def deadline(self, timeout: float | None = None) -> float | None:
        """The seconds a call may take (None: no limit); a host that hung already fails here."""

    def timed_out(self, what: str, seconds: float) -> RemoteTimeout:
        """The error of a call past its deadline; the host is not asked again this command."""

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_READ) -> bytes | None:
        """At most `limit` bytes of a file from `offset` on (a negative offset counts from its
        end: -N is its last N bytes); None if the file does not exist. Bounded: the file is the
        instance's, and may be as large as it likes."""

    def file_size(self, path: str) -> int | None:
        """The size of a file (of its holes too: a sparse file's apparent size); None if absent."""

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file atomically, creating parent directories."""

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file atomically, creating parent directories."""

    def write_chunks(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        """write_bytes of the chunks one after another, never all of them in memory here."""

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        """Incrementally mirror a local directory to `dest` on the host, telling `progress` how it goes."""

    def link_tree(self, src: str, dest: str) -> None:
        """A run's own copy of the pushed directory `src` in `dest`: each file a hard link to the
        pushed one (remote/sync/link.py), replacing a file of that name there; nothing else there
        goes. A later push replaces files, never writes into them, so the copy stays as it was."""

    def remove_tree(self, path: str) -> None:
        """Delete a directory on the host, if present."""

    def pull_tree(self, path: str, local: Path, leave_out: tuple[str, ...] = ()) -> tuple[int, tuple[str, ...]]:
        """Copy a directory from the host to `local`, but for its top-level entries named in
        `leave_out`: (files copied, "path: why" of each entry skipped: names and links that would
        leave `local`, special files; remote/sync/pull.py)."""

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        """(argv, cwd) that runs the shell line `command` (None: a login shell) in `root`, from here."""

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        """argv forwarding 127.0.0.1:local_port here to 127.0.0.1:remote_port there; None when the
        host is this machine (nothing to forward: use remote_port directly)."""

    def close(self) -> None:
        """End the connection, if any."""


class SshShell(Host, Protocol):
    """A Host reached over SSH (remote/ssh/host.py's SshHost): what the push to it (sync/ssh.py,
    sync/tar.py) needs beyond the Host contract."""

    ep: Endpoint
    has_rsync: bool | None  # None until a push finds out; False: tar from then on

    def ssh_argv(self, *extra: str) -> list[str]:
        """OpenSSH's argv to this host (its config file, key and pins), with `extra` appended."""

    def run_feeding(self, argv: Sequence[str], feed: Callable[[Any], None]) -> CommandResult:
        """Run argv with `feed(stdin)` writing its input, under the host's deadline."""

    def makedirs(self, path: str) -> None:
        """mkdir -p over SFTP."""


def output_tail(argv: Sequence[str], stdout_bytes: int = 1 << 20, stderr_bytes: int = 64 << 10) -> list[str]:
    """argv run so that only the last `stdout_bytes` of its output and `stderr_bytes` of its errors
    come back (the instance's tail keeps them; what an instance prints is never held here whole).
    For commands whose answer is their last line; the exit status is tail's, not the command's."""
    return ["sh", "-c", f'{{ "$@" 2>&1 1>&3 | tail -c {int(stderr_bytes)} 1>&2; }} 3>&1 | tail -c {int(stdout_bytes)}',
            "sh", *argv]


def read_part(fh: Any, offset: int, limit: int, size: int) -> bytes:
    """At most `limit` bytes of an open file from `offset` (negative: from its end)."""
    start = max(0, size + offset) if offset < 0 else offset
    if start:
        fh.seek(start)
    data: bytes = fh.read(max(0, limit))
    return data


PROBE_TIMED_OUT = 124


def gave_up(argv: Sequence[str], out: Tail, err: Tail, seconds: float) -> CommandResult:
    """A probe's answer when it ran past its deadline: exit 124, as `timeout` gives."""
    return CommandResult(argv=tuple(argv), returncode=PROBE_TIMED_OUT, stdout=out.text(),
                         stderr=err.text() + f"no answer within {seconds:g} s\n", dropped=out.dropped + err.dropped)


def check_result(res: CommandResult, label: str) -> CommandResult:
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip().splitlines()
        raise RemoteError(
            f"`{' '.join(res.argv[:3])} ...` failed on {label} (exit {res.returncode})"
            + (f": {detail[-1]}" if detail else "")
        )
    return res


@dataclass
class NodeFacts:
    """What one host answered in one gpuctl command: the Python its runs use (setup chose it), its
    GPUs, where its payload was pushed, its watchdog's config as read. Held by the command's
    Session (`Session.facts`), one per host, and gone with it: never by the connection or the
    process, so what a command does never depends on which command asked first. `lock`: the
    threads of one command (a node's push beside its preflight) ask one at a time."""

    python: str | None = None
    gpus: tuple[int, str | None] | None = None  # (count, why it is unknown)
    payload_dir: str | None = None
    guard_config: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def python_of(self, host: Host) -> str:
        """The Python the host's runs use: the one setup chose in this command, else the host's own."""
        return self.python or host.python
