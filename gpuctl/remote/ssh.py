"""SshHost: the Host contract over one SSH connection per command (never one per file), a Fabric
`Connection` (through the jump hosts' Connections where a ProxyJump says so: ssh_connect.py).

Host keys are verified against gpuctl's own known_hosts on every hop: the first contact pins the
key, a changed key is refused. (Fabric ignores StrictHostKeyChecking, so gpuctl enforces it with
paramiko itself; OpenSSH, for rsync and `gpuctl ssh`, gets the same file: openssh.py.) Every
command is an argv list joined with shlex.quote.
"""

from __future__ import annotations

import os
import posixpath
import re
import select
import shlex
import shutil
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from gpuctl.errors import RemoteError
from gpuctl.remote.host import check_result
from gpuctl.remote.sync import unique_suffix
from gpuctl.types import CommandResult, InstanceRecord, SyncStats

# What a host name, and a login name, may hold: they reach ssh argv and ssh config files, so no
# spaces, quotes or a leading '-' (which ssh would read as an option).
_HOST = re.compile(r"[A-Za-z0-9_.:%-]+")
_USER = re.compile(r"[A-Za-z0-9_.@+-]+")


def split_target(text: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (IPv6 as `[::1]:22`, `ssh://` allowed) -> (user or None, host, port or None)."""
    rest = text.removeprefix("ssh://")
    user, _, rest = rest.rpartition("@")
    port: int | None = None
    try:
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            if tail:
                if not tail.startswith(":"):
                    raise ValueError
                port = int(tail[1:])
        elif rest.count(":") == 1:
            host, _, p = rest.partition(":")
            port = int(p)
        else:
            host = rest
    except ValueError:
        raise ValueError(f"not a host: {text!r} (expected user@host[:port])") from None
    if (not _HOST.fullmatch(host) or host.startswith("-") or (user and (not _USER.fullmatch(user) or user.startswith("-")))
            or not (port is None or 0 < port < 65536)):
        raise ValueError(f"not a host: {text!r} (expected user@host[:port])")
    return user or None, host, port


@dataclass(frozen=True)
class Endpoint:
    """Where to SSH: `user@host:port`, the key to log in with (None: ssh-agent and ~/.ssh keys),
    and the jump hosts on the way, the first one reached directly from here (ProxyJump order)."""

    user: str
    host: str
    port: int = 22
    identity: str | None = None
    jump: tuple[Endpoint, ...] = ()
    alias: str = ""  # the ssh config `Host` it was resolved from, for messages
    # The name its host key is pinned under (OpenSSH's HostKeyAlias), when not its address: a
    # cloud recycles public IPs, so an instance is pinned by its id and its pin dropped at `down`.
    key_alias: str = ""

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def spec(self) -> str:
        """`user@host:port`, as parse() reads it back (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"

    @property
    def name(self) -> str:
        """How messages name it: the alias the user typed, where it leads, and through which hops."""
        base = f"{self.alias} ({self.label})" if self.alias and self.alias != self.host else self.label
        return base + (" via " + ", ".join(h.label for h in self.jump) if self.jump else "")

    @classmethod
    def from_record(cls, instance: InstanceRecord) -> Endpoint:
        """Where an InstanceRecord says the machine is, with the jump hosts recorded at `up`."""
        keys = (*instance.jump_keys, *[""] * len(instance.jump_hosts))
        jump = tuple(replace(cls.parse(h), identity=k or None) for h, k in zip(instance.jump_hosts, keys))
        return cls(user=instance.ssh_user or "", host=instance.public_ip or "", port=instance.port or 22,
                   identity=instance.key_path, jump=jump)

    @classmethod
    def parse(cls, text: str, default_user: str = "") -> Endpoint:
        """`[user@]host[:port]`; IPv6 as `[::1]:22`. A bare name may be an ssh config alias."""
        import getpass

        user, host, port = split_target(text)
        return cls(user=user or default_user or getpass.getuser(), host=host, port=port or 22)


def known_hosts_path(home: Path) -> Path:
    return home / "known_hosts"


def forget_host_keys(home: Path, names: set[str]) -> int:
    """Drop the pins of these names (key aliases of released instances); how many lines went."""
    path = known_hosts_path(home)
    if not names or not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.split(" ", 1)[0] not in names]
    if len(kept) != len(lines):
        tmp = path.with_name(f".known_hosts.{unique_suffix()}.tmp")
        tmp.write_text("".join(kept))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return len(lines) - len(kept)


class SshHost:
    """A machine reached over SSH; `root` is gpuctl's work directory there (absolute).

    `identity` (when given) is the host's key and wins over `ep.identity`; the jump hosts log in
    with their own (`ep.jump[i].identity`)."""

    def __init__(self, ep: Endpoint, home: Path, identity: str | None, workdir: str, python: str = "",
                 connect_timeout_s: float = 30.0, retry_auth: bool = False,
                 progress: Callable[[str], None] | None = None, tmux_socket: str = "gpuctl"):
        from gpuctl.remote.ssh_connect import open_chain

        ep = replace(ep, identity=identity or ep.identity)
        self.ep = ep
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
            stdin: bytes | None = None) -> CommandResult:
        try:
            chan = self._client.get_transport().open_session()
            chan.exec_command(self.command_line(argv, cwd and bool(self.root)))
        except Exception as exc:
            raise self._lost(exc) from None
        if stdin is not None:
            chan.sendall(stdin)
            chan.shutdown_write()
        return self._finish(chan, argv, check, timeout)

    def run_feeding(self, argv: Sequence[str], feed: Callable[[Any], None]) -> CommandResult:
        """Run argv with its stdin written by `feed(stream)` while it runs: `stream.write` blocks
        while SSH's window is full, so memory stays flat whatever is sent. A command that ends
        early (it refused the input, the disk filled) ends the feeding; its result says why."""
        chan = self._client.get_transport().open_session()
        chan.exec_command(self.command_line(argv, False))

        class Gone(Exception):
            pass

        class Stream:
            def write(self, data: bytes) -> int:
                try:
                    chan.sendall(data)
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
        return self._finish(chan, argv, False, None)

    def _lost(self, exc: Exception) -> Exception:
        """The connection dropped (the machine went away): a RemoteError that says so, not paramiko's
        exception; anything else as it was."""
        if isinstance(exc, (EOFError, OSError)) or type(exc).__module__.startswith("paramiko"):
            return RemoteError(f"lost the connection to {self.label} ({type(exc).__name__}: {exc})",
                               "The machine may be gone: `gpuctl status` asks its provider.")
        return exc

    def _finish(self, chan: Any, argv: Sequence[str], check: bool, timeout: float | None) -> CommandResult:
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # read both streams as they come: a full stderr window must not stall stdout
            if chan.recv_ready():
                out += chan.recv(65536)
            elif chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            elif chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            else:
                select.select([chan], [], [], 0.5)
                if deadline and time.monotonic() > deadline:
                    chan.close()
                    raise RemoteError(f"`{' '.join(argv[:3])} ...` timed out after {timeout}s on {self.label}")
        code = chan.recv_exit_status()
        chan.close()
        res = CommandResult(argv=tuple(argv), returncode=code, stdout=out.decode("utf-8", "replace"),
                            stderr=err.decode("utf-8", "replace"))
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
        return self._conn.sftp()  # Fabric opens it once, on the host's connection, and keeps it

    def read_bytes(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with self.sftp.open(path, "rb") as fh:
                if offset:
                    fh.seek(offset)
                else:
                    fh.prefetch()  # pipelined reads: one round trip's wait, not one per 32 KB
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            if getattr(exc, "errno", None) == 2:
                return None
            raise RemoteError(f"cannot read {path} on {self.label}: {exc}") from None
        except Exception as exc:
            raise self._lost(exc) from None

    def makedirs(self, path: str) -> None:
        """mkdir -p over SFTP: no remote shell (whose startup files can cost 100 ms a command)."""
        missing = []
        while path and path != "/":
            try:
                self.sftp.stat(path)
                break
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
            except OSError as exc:
                raise RemoteError(f"cannot create {d} on {self.label}: {exc}", "Is the disk full, or the path not writable?") from None

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.write_bytes(path, text.encode("utf-8"), mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        parent = posixpath.dirname(path)
        self.makedirs(parent)
        # Unique: concurrent commands (two syncs) writing one file must not share a temporary name.
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{unique_suffix()}.tmp")
        try:
            with self.sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                fh.write(data)
            self.sftp.chmod(tmp, mode)
            self.sftp.posix_rename(tmp, path)
        except OSError as exc:
            raise RemoteError(f"cannot write {path} on {self.label}: {exc}", "Is the disk full? `gpuctl exec -- df -h`") from None

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        from gpuctl.remote.sync import push_remote

        return push_remote(self, src, dest, progress=progress)

    def fetch(self, path: str, local: Path) -> bool:
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.sftp.get(path, str(local))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if getattr(exc, "errno", None) == 2:
                return False
            raise

    def remove_tree(self, path: str) -> None:
        self.run(["rm", "-rf", "--", path])

    def pull_tree(self, path: str, local: Path) -> tuple[int, tuple[str, ...]]:
        """rsync from the host where both ends have it, else an SFTP walk (same connection); both
        keep what the instance lists inside `local` (remote/pull.py)."""
        import subprocess

        from gpuctl.remote.pull import pull_walk
        from gpuctl.remote.sync import REMOTE_RSYNC_MISSING, _rsync_host

        local.mkdir(parents=True, exist_ok=True)
        if self.has_rsync is not False and shutil.which("rsync"):
            # --safe-links: no link that is absolute or climbs out of the tree is recreated here;
            # --no-D: no device or FIFO either (as the SFTP walk).
            proc = subprocess.run(
                ["rsync", "-a", "--safe-links", "--no-D", "--stats", "-e", shlex.join(self.ssh_argv()),
                 f"{self.ep.user}@{_rsync_host(self.ep.host)}:{path}/", f"{local}/"],
                capture_output=True, text=True,
            )
            if proc.returncode in (12, 126, 127) and REMOTE_RSYNC_MISSING.search(proc.stderr):
                self.has_rsync = False  # the documented fallback: SFTP below
            elif proc.returncode != 0:
                raise RemoteError(f"pull from {self.label} failed: {proc.stderr.strip()[-300:]}")
            else:
                return sum(len(files) for _, _, files in os.walk(local)), ()
        return pull_walk(self.sftp, path, local)

    def ssh_argv(self, *extra: str) -> list[str]:
        """An OpenSSH client command for this host (the caller adds `user@host`): through the same
        jump hosts, with every hop's key checked strictly against gpuctl's known_hosts. The hops'
        options live in a config file gpuctl writes (`-F`): OpenSSH applies `-o` to the host only."""
        from gpuctl.remote.openssh import config_file

        if self._openssh_config is None:
            self._openssh_config = config_file(self.ep, self.home)
        argv = ["ssh", "-F", str(self._openssh_config), "-p", str(self.ep.port),
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
        return argv + list(extra)

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        """(argv, cwd): OpenSSH running the shell line `command` (None: a login shell) in `root`."""
        line = shlex.join(["cd", self.root]) + "; " + (command if command is not None else 'exec "$SHELL" -l')
        return self.ssh_argv("-t" if tty else "-T", self.target, line), None

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        """OpenSSH forwarding 127.0.0.1:local_port here to 127.0.0.1:remote_port on the host."""
        return self.ssh_argv("-N", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}", self.target)

    @property
    def target(self) -> str:
        """`user@host` for the ssh_argv() command line."""
        return f"{self.ep.user}@{self.ep.host}"

    def close(self) -> None:
        from gpuctl.remote.ssh_connect import close_all

        close_all(self._conns)


def tcp_reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
