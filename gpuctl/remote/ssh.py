"""SshHost: the Host contract over one paramiko connection per command (never one per file).

Host keys are verified against gpuctl's own known_hosts: the first contact pins the key, a
changed key is refused. (Fabric ignores StrictHostKeyChecking, so gpuctl enforces it with
paramiko itself.) Every command is an argv list joined with shlex.quote.
"""

from __future__ import annotations

import posixpath
import select
import shlex
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from gpuctl.errors import RemoteError
from gpuctl.remote.host import check_result
from gpuctl.types import CommandResult, SyncStats


@dataclass(frozen=True)
class Endpoint:
    user: str
    host: str
    port: int = 22

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str, default_user: str = "") -> "Endpoint":
        """`[user@]host[:port]`; IPv6 as `[::1]:22`."""
        import getpass

        user, _, rest = text.rpartition("@")
        user = user or default_user or getpass.getuser()
        port = 22
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            if tail.startswith(":"):
                port = int(tail[1:])
        elif rest.count(":") == 1:
            host, _, p = rest.partition(":")
            port = int(p)
        else:
            host = rest
        if not host or not (0 < port < 65536):
            raise ValueError(f"not a host: {text!r} (expected user@host[:port])")
        return cls(user=user, host=host, port=port)


def known_hosts_path(home: Path) -> Path:
    return home / "known_hosts"


def _pin_policy(path: Path) -> Any:
    import paramiko

    class PinOnFirstContact(paramiko.MissingHostKeyPolicy):
        """Trust a host's key the first time and remember it; paramiko refuses a changed one."""

        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return PinOnFirstContact()


def connect(ep: Endpoint, home: Path, identity: str | None, timeout_s: float, retry_auth: bool = False,
            progress: Callable[[str], None] | None = None) -> Any:
    """A connected paramiko SSHClient, retrying with backoff while the host boots, up to `timeout_s`."""
    import paramiko

    known = known_hosts_path(home)
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    last = ""
    while True:
        client = paramiko.SSHClient()
        if known.exists():
            client.load_host_keys(str(known))
        client.set_missing_host_key_policy(_pin_policy(known))
        remaining = max(1.0, deadline - time.monotonic())
        try:
            client.connect(
                ep.host, port=ep.port, username=ep.user, key_filename=identity or None,
                timeout=min(10.0, remaining), banner_timeout=min(15.0, remaining), auth_timeout=min(15.0, remaining),
                look_for_keys=identity is None, allow_agent=identity is None,
            )
            client.get_transport().set_keepalive(30)
            return client
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise RemoteError(
                f"the host key of {ep.label} has CHANGED (expected {exc.expected_key.get_name()} "
                f"{exc.expected_key.get_fingerprint().hex()[:16]}..., got {exc.key.get_fingerprint().hex()[:16]}...)",
                f"If the machine was rebuilt, delete its line from {known}; otherwise do not connect: "
                "someone may be intercepting the connection.",
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            if not retry_auth or time.monotonic() > deadline:
                raise RemoteError(
                    f"{ep.label} refused the key{(' ' + identity) if identity else ''}: {exc}",
                    "Pass the right key with --identity, and check it is in the host's authorized_keys.",
                ) from None
            last = f"key not accepted yet ({exc})"
        except (OSError, EOFError, paramiko.SSHException) as exc:
            client.close()
            last = str(exc) or type(exc).__name__
        if time.monotonic() + delay > deadline:
            raise RemoteError(
                f"cannot connect to {ep.label}: timed out after {timeout_s:.0f}s ({last})",
                "Is the host up and reachable from here? Check the address, the port, and any firewall "
                "or security group (`remote.connect_timeout_s` sets the wait).",
            )
        if progress:
            progress(f"waiting for SSH on {ep.label}: {last}")
        time.sleep(delay)
        delay = min(delay * 2, 8.0)


class SshHost:
    """A machine reached over SSH; `root` is gpuctl's work directory there (absolute)."""

    def __init__(self, ep: Endpoint, home: Path, identity: str | None, workdir: str, python: str = "",
                 connect_timeout_s: float = 30.0, retry_auth: bool = False,
                 progress: Callable[[str], None] | None = None):
        self.ep = ep
        self.home = home
        self.identity = identity
        self.label = ep.label
        self.tmux_socket = "gpuctl"
        self.root = ""  # set below, once $HOME is known
        self._client = connect(ep, home, identity, connect_timeout_s, retry_auth, progress)
        self._sftp: Any = None
        self.has_rsync: bool | None = None  # learnt on the first push
        if workdir.startswith("~"):
            remote_home = self.run(["sh", "-c", 'printf %s "$HOME"'], cwd=False).stdout.strip()
            workdir = remote_home + workdir[1:]
        self.root = workdir
        self._python = python

    # --- commands -------------------------------------------------------------------------------

    def command_line(self, argv: Sequence[str], cwd: bool = True) -> str:
        cmd = shlex.join(list(argv))
        return f"cd {shlex.quote(self.root)} 2>/dev/null; {cmd}" if cwd else cmd

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None, cwd: bool = True,
            stdin: bytes | None = None) -> CommandResult:
        chan = self._client.get_transport().open_session()
        chan.exec_command(self.command_line(argv, cwd and bool(self.root)))
        if stdin is not None:
            chan.sendall(stdin)
            chan.shutdown_write()
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
        if not self._python:
            from gpuctl.remote.preflight import find_python

            self._python = find_python(self)
        return self._python

    # --- files ----------------------------------------------------------------------------------

    @property
    def sftp(self) -> Any:
        if self._sftp is None:
            self._sftp = self._client.open_sftp()
        return self._sftp

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
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp")
        try:
            with self.sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                fh.write(data)
            self.sftp.chmod(tmp, mode)
            self.sftp.posix_rename(tmp, path)
        except OSError as exc:
            raise RemoteError(f"cannot write {path} on {self.label}: {exc}", "Is the disk full? `gpuctl exec -- df -h`") from None

    def push(self, src: Path, dest: str) -> SyncStats:
        from gpuctl.remote.sync import push_remote

        return push_remote(self, src, dest)

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

    def pull_tree(self, path: str, local: Path) -> int:
        """rsync from the host where both ends have it, else an SFTP walk (same connection)."""
        import stat
        import subprocess

        from gpuctl.remote.sync import _rsync_host

        local.mkdir(parents=True, exist_ok=True)
        if self.has_rsync is not False and shutil.which("rsync"):
            proc = subprocess.run(
                ["rsync", "-a", "--stats", "-e", shlex.join(self.ssh_argv()),
                 f"{self.ep.user}@{_rsync_host(self.ep.host)}:{path}/", f"{local}/"],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise RemoteError(f"pull from {self.label} failed: {proc.stderr.strip()[-300:]}")
            return sum(len(files) for _, _, files in __import__("os").walk(local))
        count = 0
        stack = [(path, local)]
        while stack:
            rdir, ldir = stack.pop()
            ldir.mkdir(parents=True, exist_ok=True)
            for entry in self.sftp.listdir_attr(rdir):
                rpath = posixpath.join(rdir, entry.filename)
                if stat.S_ISDIR(entry.st_mode or 0):
                    stack.append((rpath, ldir / entry.filename))
                else:
                    self.sftp.get(rpath, str(ldir / entry.filename))
                    count += 1
        return count

    def ssh_argv(self, *extra: str) -> list[str]:
        """An OpenSSH client command for this host with gpuctl's strict host key checking."""
        argv = [
            "ssh", "-p", str(self.ep.port),
            "-o", f"UserKnownHostsFile={known_hosts_path(self.home)}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20",
        ]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        return argv + list(extra)

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self._client.close()


def tcp_reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
