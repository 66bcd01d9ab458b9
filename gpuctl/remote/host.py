"""Host: run commands and move files on an instance, the same way whether it is this machine or
(later) one reached over SSH, as Fabric's Connection mirrors Invoke's Context.

Commands are argv lists, never shell strings: the local host passes them to exec directly and a
remote host joins them with shlex.quote, so no user-controlled string reaches a shell unquoted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Protocol, Sequence

from gpuctl.errors import RemoteError
from gpuctl.remote.sync import push_local, unique_suffix
from gpuctl.types import CommandResult, SyncStats


class Host(Protocol):
    root: str  # gpuctl's working directory on the host (code, runs, payload live below it)
    tmux_socket: str  # name of gpuctl's own tmux server there (`tmux -L`), apart from the user's
    label: str  # how errors name this host
    python: str  # the interpreter that runs the payload unless `remote.python` says otherwise
    local: bool  # True: this machine itself (nothing to check first, nothing to forward)

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None) -> CommandResult:
        """Run argv on the host; with check, a non-zero exit raises RemoteError."""

    def read_bytes(self, path: str, offset: int = 0) -> bytes | None:
        """Bytes of a file from `offset` on; None if the file does not exist."""

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file atomically, creating parent directories."""

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file atomically, creating parent directories."""

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        """Incrementally mirror a local directory to `dest` on the host, telling `progress` how it goes."""

    def fetch(self, path: str, local: Path) -> bool:
        """Copy a file from the host; False if it does not exist there."""

    def remove_tree(self, path: str) -> None:
        """Delete a directory on the host, if present."""

    def pull_tree(self, path: str, local: Path) -> tuple[int, tuple[str, ...]]:
        """Copy a directory from the host to `local`: (files copied, "path: why" of each entry
        skipped: names and links that would leave `local`, special files; remote/pull.py)."""

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        """(argv, cwd) that runs the shell line `command` (None: a login shell) in `root`, from here."""

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        """argv forwarding 127.0.0.1:local_port here to 127.0.0.1:remote_port there; None when the
        host is this machine (nothing to forward: use remote_port directly)."""

    def close(self) -> None:
        """End the connection, if any."""


def check_result(res: CommandResult, label: str) -> CommandResult:
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip().splitlines()
        raise RemoteError(
            f"`{' '.join(res.argv[:3])} ...` failed on {label} (exit {res.returncode})"
            + (f": {detail[-1]}" if detail else "")
        )
    return res


class LocalHost:
    """This machine playing the instance; `root` is the cluster's work directory."""

    def __init__(self, root: Path):
        self.root = str(root)
        self.label = "local"
        self.local = True
        self.python = sys.executable
        # One tmux server per cluster root, so clusters (and test runs) never see each other's jobs.
        self.tmux_socket = "gpuctl-" + hashlib.sha1(self.root.encode()).hexdigest()[:12]

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None) -> CommandResult:
        try:
            cwd = self.root if os.path.isdir(self.root) else None  # e.g. killing a removed cluster's tmux
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd)
        except FileNotFoundError:
            if not check:  # as a shell says it: `exec` passes 127 through, as over SSH
                return CommandResult(argv=tuple(argv), returncode=127, stdout="",
                                     stderr=f"{argv[0]}: command not found\n")
            raise RemoteError(
                f"`{argv[0]}` is not installed on {self.label}", f"Install it (e.g. `apt-get install {argv[0]}`)."
            ) from None
        except subprocess.TimeoutExpired:
            raise RemoteError(f"`{' '.join(argv[:3])} ...` timed out after {timeout}s on {self.label}") from None
        res = CommandResult(argv=tuple(argv), returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
        return check_result(res, self.label) if check else res

    def read_bytes(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except FileNotFoundError:
            return None

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.write_bytes(path, text.encode("utf-8"), mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{unique_suffix()}.tmp")  # concurrent writers
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, p)

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        return push_local(src, Path(dest), progress=progress)

    def fetch(self, path: str, local: Path) -> bool:
        if not os.path.isfile(path):
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, local)
        return True

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def pull_tree(self, path: str, local: Path) -> tuple[int, tuple[str, ...]]:
        from gpuctl.remote.pull import LocalFiles, pull_walk

        if not os.path.isdir(path):
            return 0, ()
        return pull_walk(LocalFiles(), path, local)

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        if command is None:
            return [os.environ.get("SHELL", "/bin/sh")], self.root
        return ["/bin/sh", "-c", command], self.root

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        return None

    def close(self) -> None:
        pass
