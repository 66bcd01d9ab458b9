"""SshHost: the Host contract over one SSH connection per command (never one per file), a Fabric
`Connection` (through the jump hosts' Connections where a ProxyJump says so: connect.py).

Host keys are verified against gpuctl's own known_hosts on every hop: the first contact pins the
key, a changed key is refused. (Fabric ignores StrictHostKeyChecking, so gpuctl enforces it with
paramiko itself; OpenSSH, for rsync and `gpuctl ssh`, gets the same file: openssh.py.) Every
command is an argv list joined with shlex.quote.
"""

from __future__ import annotations

import os
import posixpath
import select
import shlex
import shutil
import stat
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from gpuctl.errors import RemoteError, UnreadableFile
from gpuctl.model.endpoint import Endpoint
from gpuctl.model.records import CommandResult, SyncStats
from gpuctl.model.untrusted import MAX_READ
from gpuctl.remote.host import (COMMAND_TIMEOUT_S, MAX_OUTPUT, REMOVE_TIMEOUT_S, Deadlines, Tail, check_result,
                                gave_up, shown)
from gpuctl.remote.ssh.connect import close_all, open_chain
from gpuctl.remote.ssh.openssh import config_file
from gpuctl.files import unique_suffix
from gpuctl.remote.sync.link import link_argv
from gpuctl.remote.sync.pull import current_umask, pull_walk, rsync_chmod, rsync_left_out
from gpuctl.remote.sync.ssh import REMOTE_RSYNC_MISSING, RSYNC_TIMED_OUT, push_remote, rsync_host

# How long a finished command's streams may stay open (a background child holding them) before
# its result is taken without their EOF.
EXIT_DRAIN_S = 2.0


class SshHost(Deadlines):
    """A machine reached over SSH; `root` is gpuctl's work directory there (absolute).

    `identity` (when given) is the host's key and wins over `ep.identity`; the jump hosts log in
    with their own (`ep.jump[i].identity`)."""

    def __init__(self, ep: Endpoint, home: Path, identity: str | None, workdir: str, python: str = "",
                 connect_timeout_s: float = 30.0, retry_auth: bool = False,
                 progress: Callable[[str], None] | None = None, tmux_socket: str = "gpuctl",
                 command_timeout_s: float = COMMAND_TIMEOUT_S):
        ep = replace(ep, identity=identity or ep.identity)
        self.ep = ep
        self.command_timeout_s = command_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.home = home
        self.identity = ep.identity
        self.label = ep.name
        self.tmux_socket = tmux_socket
        self.local = False
        self.root = ""  # set below, once $HOME is known
        # One Fabric Connection per hop, the host's last; kept for the whole command.
        self._conns = open_chain(ep, home, connect_timeout_s, retry_auth, progress)
        self._conn = self._conns[-1]
        self._client = self._conn.client
        self.has_rsync: bool | None = None  # learnt on the first push
        self._openssh_config: Path | None = None
        try:
            if workdir.startswith("~"):
                remote_home = self.run(["sh", "-c", 'printf %s "$HOME"'], cwd=False).stdout.strip()
                workdir = remote_home + workdir[1:]
        except BaseException:
            self.close()
            raise
        self.root = workdir
        self._python = python

    # --- commands -------------------------------------------------------------------------------

    def command_line(self, argv: Sequence[str], cwd: bool = True) -> str:
        cmd = shlex.join(list(argv))
        return f"cd {shlex.quote(self.root)} 2>/dev/null; {cmd}" if cwd else cmd

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None, cwd: bool = True,
            output_limit: int | None = MAX_OUTPUT, probe: bool = False, stdin: bytes | None = None) -> CommandResult:
        # stdin last: the Host protocol's parameters come first, in its order (any caller may pass them by place).
        limit = self.deadline(timeout)
        chan = self._start(argv, cwd and bool(self.root), limit)
        if stdin is not None:
            chan.sendall(stdin)
            chan.shutdown_write()
        return self._finish(chan, argv, check, limit, output_limit, probe)

    @contextmanager
    def _cut_after(self, limit: float | None, what: str) -> Iterator[None]:
        """For paramiko calls that wait without a timeout of their own (a channel's exec request,
        opening SFTP): past `limit` the connection is closed under them, which ends the wait, and
        the host counts as hung."""
        if limit is None:
            yield
            return
        fired = threading.Event()

        def cut() -> None:
            fired.set()
            try:
                self._client.get_transport().close()
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass

        timer = threading.Timer(limit, cut)
        timer.daemon = True
        timer.start()
        try:
            yield
        except Exception:
            if fired.is_set():
                raise self.timed_out(what, limit) from None
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise self.timed_out(what, limit)

    def _start(self, argv: Sequence[str], cwd: bool, limit: float | None) -> Any:
        """A channel running argv (its exec request answered within `limit`)."""
        with self._cut_after(limit, shown(argv)):
            try:
                chan = self._client.get_transport().open_session(timeout=limit)
                chan.exec_command(self.command_line(argv, cwd))
            except Exception as exc:
                raise self._lost(exc) from None
        return chan

    def run_feeding(self, argv: Sequence[str], feed: Callable[[Any], None]) -> CommandResult:
        """Run argv with its stdin written by `feed(stream)` while it runs: `stream.write` blocks
        while SSH's window is full, so memory stays flat whatever is sent. A command that ends
        early (it refused the input, the disk filled) ends the feeding; its result says why. A
        command that takes no input for command_timeout_s is a hung host (RemoteTimeout)."""
        limit = self.deadline()
        chan = self._start(argv, False, limit)
        chan.settimeout(limit)  # how long one write may wait for the window to open
        host = self

        class Gone(Exception):
            pass

        class Stream:
            def write(self, data: bytes) -> int:
                try:
                    chan.sendall(data)
                except socket.timeout:
                    raise host.timed_out(f"{shown(argv)} taking its input", limit or 0) from None
                except (OSError, EOFError) as exc:
                    raise Gone() from exc
                return len(data)

        try:
            feed(Stream())
            chan.shutdown_write()
        except Gone:
            pass  # the command is gone: its exit status and stderr tell
        except BaseException:
            chan.close()  # the feeding failed here: the command sees its input end, not a pause
            raise
        return self._finish(chan, argv, False, limit)

    def _connected(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def _lost(self, exc: Exception) -> Exception:
        """The connection dropped (the machine went away): a RemoteError that says so, not paramiko's
        exception; anything else as it was."""
        if isinstance(exc, (EOFError, OSError)) or type(exc).__module__.startswith("paramiko"):
            return RemoteError(f"lost the connection to {self.label} ({type(exc).__name__}: {exc})",
                               "The machine may be gone: `gpuctl status` asks its provider.")
        return exc

    def _finish(self, chan: Any, argv: Sequence[str], check: bool, timeout: float | None,
                output_limit: int | None = MAX_OUTPUT, probe: bool = False) -> CommandResult:
        # Each Tail keeps the last output_limit bytes: paramiko's buffer is bounded by the SSH
        # window, so memory stays flat whatever the command (or the shell's start-up files) prints.
        out, err = Tail(output_limit), Tail(output_limit)
        deadline = None if timeout is None else time.monotonic() + timeout
        drained: float | None = None  # when to stop waiting for EOF once the exit status is in
        while True:  # read both streams as they come: a full stderr window must not stall stdout
            if deadline and time.monotonic() > deadline:  # a command that never stops printing too
                chan.close()
                if probe:
                    return gave_up(argv, out, err, timeout or 0)
                raise self.timed_out(shown(argv), timeout or 0)
            if chan.recv_ready():
                out.add(chan.recv(65536))
            elif chan.recv_stderr_ready():
                err.add(chan.recv_stderr(65536))
            elif chan.exit_status_ready() and (chan.eof_received or chan.closed or drained is not None
                                               and time.monotonic() > drained):
                break
            else:
                if chan.exit_status_ready() and drained is None:
                    # sshd may send the exit status before the last of stderr (seen: 8 bytes of a
                    # 3 MB stderr came after it): read on until EOF. A background child that
                    # holds the streams open keeps EOF away, so a short quiet spell ends it too.
                    drained = time.monotonic() + EXIT_DRAIN_S
                select.select([chan], [], [], 0.5 if drained is None else 0.1)
        code = chan.recv_exit_status()
        chan.close()
        if code == -1 and not (chan.eof_received and self._connected()):
            # paramiko's -1: the channel closed without an exit status. A command killed by a
            # signal ends so too (paramiko ignores exit-signal), but its sshd still sent EOF first;
            # a connection that went sent nothing (and paramiko closes its channels a moment before
            # it marks the transport inactive, so that alone may not show yet). That is no answer
            # from the command: a caller reading "no such session" from it decided on what the
            # host never said.
            raise self._lost(EOFError(f"the connection closed before {shown(argv)} finished"))
        res = CommandResult(argv=tuple(argv), returncode=code, stdout=out.text(), stderr=err.text(),
                            dropped=out.dropped + err.dropped)
        if code == 127 and check:
            raise RemoteError(f"`{argv[0]}` is not installed on {self.label}",
                              f"Install it there (e.g. `sudo apt-get install {Path(argv[0]).name}`).")
        return check_result(res, self.label) if check else res

    @property
    def python(self) -> str:
        """The Python payloads run with: remote.python, or what ops/setup.py chose for the runs;
        before that the host's python3 (the watchdog and the guard check need only the stdlib)."""
        return self._python or "python3"

    @python.setter
    def python(self, path: str) -> None:
        self._python = path  # the setup step's choice (ops/setup.py)

    # --- files ----------------------------------------------------------------------------------

    @property
    def sftp(self) -> Any:
        """The host's SFTP session (Fabric opens it once and keeps it); a reply that does not come
        within command_timeout_s raises socket.timeout (`_sftp_call` names it)."""
        limit = self.deadline()
        if getattr(self._conn, "_sftp", None) is None:
            with self._cut_after(limit, "opening SFTP"):
                try:
                    self._conn.sftp().get_channel().settimeout(limit)
                except Exception as exc:
                    raise self._lost(exc) from None
        return self._conn.sftp()

    @contextmanager
    def _sftp_call(self, what: str) -> Iterator[None]:
        """An SFTP call whose reply did not come within command_timeout_s: the host is hung; one
        whose connection dropped under it (paramiko's SSHException, EOFError): the host is lost."""
        try:
            yield
        except socket.timeout:
            raise self.timed_out(what, self.command_timeout_s) from None
        except EOFError as exc:
            raise self._lost(exc) from None
        except Exception as exc:
            if type(exc).__module__.startswith("paramiko"):
                raise self._lost(exc) from None
            raise

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_READ) -> bytes | None:
        with self._sftp_call(f"reading {path}"):
            try:
                with self.sftp.open(path, "rb") as fh:
                    size = fh.stat().st_size
                    start = max(0, size + offset) if offset < 0 else offset
                    end = min(size, start + max(0, limit))
                    if start >= end:
                        return b""
                    fh.seek(start)
                    fh.prefetch(end)  # pipelined reads of the part wanted: one round trip's wait, not one per 32 KB
                    data: bytes = fh.read(end - start)
                    return data
            except OSError as exc:
                self._absent(exc, f"cannot read {path}")
                return None

    def file_size(self, path: str) -> int | None:
        with self._sftp_call(f"looking at {path}"):
            try:
                size: int = self.sftp.stat(path).st_size
                return size
            except OSError as exc:
                self._absent(exc, f"cannot look at {path}")
                return None

    def _absent(self, exc: OSError, what: str) -> None:
        """None for a file that is not there; else the file cannot be read as one (a link loop the
        job made): UnreadableFile. A timeout is the host's, for _sftp_call to say."""
        if isinstance(exc, socket.timeout):
            raise exc
        if isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == 2:
            return None
        raise UnreadableFile(f"{what} on {self.label}: {exc}") from None

    def makedirs(self, path: str) -> None:
        """mkdir -p over SFTP: no remote shell (whose startup files can cost 100 ms a command)."""
        missing = []
        while path and path != "/":
            try:
                self.sftp.stat(path)
                break
            except socket.timeout:
                raise self.timed_out(f"looking at {path}", self.command_timeout_s) from None
            except FileNotFoundError:
                missing.append(path)
                path = posixpath.dirname(path)
            except OSError as exc:
                if getattr(exc, "errno", None) != 2:
                    raise RemoteError(f"cannot create {path} on {self.label}: {exc}") from None
                missing.append(path)
                path = posixpath.dirname(path)
        for d in reversed(missing):
            try:
                self.sftp.mkdir(d)
            except socket.timeout:
                raise self.timed_out(f"creating {d}", self.command_timeout_s) from None
            except OSError as exc:
                if self._is_dir(d):  # made meanwhile by another push to the same place: as mkdir -p
                    continue
                raise RemoteError(f"cannot create {d} on {self.label}: {exc}", "Is the disk full, or the path not writable?") from None

    def _is_dir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self.sftp.stat(path).st_mode or 0)
        except (OSError, socket.timeout):
            return False

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.write_bytes(path, text.encode("utf-8"), mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.write_chunks(path, (data,), mode)

    def write_chunks(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        parent = posixpath.dirname(path)
        self.makedirs(parent)
        # Unique: concurrent commands (two syncs) writing one file must not share a temporary name.
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{unique_suffix()}.tmp")
        try:
            with self.sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                for chunk in chunks:
                    fh.write(chunk)
            self.sftp.chmod(tmp, mode)
            self.sftp.posix_rename(tmp, path)
        except socket.timeout:
            raise self.timed_out(f"writing {path}", self.command_timeout_s) from None
        except OSError as exc:
            raise RemoteError(f"cannot write {path} on {self.label}: {exc}", "Is the disk full? `gpuctl exec -- df -h`") from None

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        return push_remote(self, src, dest, progress=progress)

    def link_tree(self, src: str, dest: str) -> None:
        self.run(link_argv(src, dest), timeout=REMOVE_TIMEOUT_S)  # a big data set: many links

    def remove_tree(self, path: str) -> None:
        self.run(["rm", "-rf", "--", path], timeout=REMOVE_TIMEOUT_S)

    def pull_tree(self, path: str, local: Path, leave_out: tuple[str, ...] = ()) -> tuple[int, tuple[str, ...]]:
        """rsync from the host where both ends have it, else an SFTP walk (same connection); both
        keep what the instance lists inside `local` (remote/sync/pull.py)."""
        import subprocess

        local.mkdir(parents=True, exist_ok=True)
        if self.has_rsync is not False and shutil.which("rsync"):
            # --safe-links: no link that is absolute or climbs out of the tree is recreated here;
            # --no-D: no device or FIFO either (as the SFTP walk). --info=name1 with an empty
            # --out-format prints what those two skipped (as "ignoring unsafe symlink") and no names.
            limit = self.deadline()
            # --timeout: a host that sends nothing for that long ends the pull (rsync exits 30).
            proc = subprocess.run(
                # -rlpt, not -a: no owner or group from the instance (root would keep them), and
                # --chmod makes its modes safe (remote/sync/pull.py pulled_mode), files pulled before too.
                ["rsync", "-rlpt", f"--chmod={rsync_chmod(current_umask())}", "--safe-links", "--no-D",
                 "--info=name1,nonreg1", "--out-format=",
                 *([f"--timeout={max(1, round(limit))}"] if limit else []),
                 *[f"--exclude=/{name}" for name in leave_out],  # anchored: the top's entry only
                 "-e", shlex.join(self.ssh_argv()),
                 f"{self.ep.user}@{rsync_host(self.ep.host)}:{path}/", f"{local}/"],
                capture_output=True, text=True,
            )
            if proc.returncode == RSYNC_TIMED_OUT:
                raise self.timed_out(f"rsync of {path}", limit or 0)
            if proc.returncode in (12, 126, 127) and REMOTE_RSYNC_MISSING.search(proc.stderr):
                self.has_rsync = False  # the documented fallback: SFTP below
            elif proc.returncode != 0:
                raise RemoteError(f"pull from {self.label} failed: {proc.stderr.strip()[-300:]}")
            else:
                return sum(len(files) for _, _, files in os.walk(local)), rsync_left_out(proc.stdout)
        with self._sftp_call(f"copying {path}"):
            return pull_walk(self.sftp, path, local, leave_out)

    def ssh_argv(self, *extra: str) -> list[str]:
        """An OpenSSH client command for this host (the caller adds `user@host`): through the same
        jump hosts, with every hop's key checked strictly against gpuctl's known_hosts. The hops'
        options live in a config file gpuctl writes (`-F`): OpenSSH applies `-o` to the host only."""
        if self._openssh_config is None:
            self._openssh_config = config_file(self.ep, self.home)
        argv = ["ssh", "-F", str(self._openssh_config), "-p", str(self.ep.port),
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                # A host that stops answering is given up on (rsync, a forward) rather than waited for.
                "-o", f"ConnectTimeout={max(1, round(self.connect_timeout_s))}",
                "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
        return argv + list(extra)

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        """(argv, cwd): OpenSSH running the shell line `command` (None: a login shell) in `root`."""
        line = shlex.join(["cd", self.root]) + "; " + (command if command is not None else 'exec "$SHELL" -l')
        return self.ssh_argv("-t" if tty else "-T", self.target, line), None

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        """OpenSSH forwarding 127.0.0.1:local_port here to 127.0.0.1:remote_port on the host."""
        # A port taken between gpuctl's check and ssh's bind: ssh fails rather than only warns.
        return self.ssh_argv("-N", "-o", "ExitOnForwardFailure=yes",
                             "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}", self.target)

    @property
    def target(self) -> str:
        """`user@host` for the ssh_argv() command line."""
        return f"{self.ep.user}@{self.ep.host}"

    def close(self) -> None:
        close_all(self._conns)
