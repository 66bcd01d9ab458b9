"""This machine playing the instance (the local provider's host): commands exec'd without a
shell, files copied on this disk, each command under the deadline rule every host keeps."""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from gpuctl.errors import RemoteError, UnreadableFile
from gpuctl.model.records import CommandResult, SyncStats
from gpuctl.model.untrusted import MAX_READ
from gpuctl.remote.host import (COMMAND_TIMEOUT_S, MAX_OUTPUT, Deadlines, Tail, check_result, gave_up, read_part,
                                shown)
from gpuctl.files import unique_suffix
from gpuctl.remote.sync import push_local
from gpuctl.remote.sync.link import link_local
from gpuctl.remote.sync.pull import LocalFiles, pull_walk


def _drain(proc: subprocess.Popen[bytes], out: Tail, err: Tail, limit: float | None) -> bool:
    """Read both pipes as they come until the command ends (True), or until `limit` seconds have
    passed (False); each Tail keeps what it may, so memory stays flat whatever is printed."""
    deadline = None if limit is None else time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        for pipe, tail in ((proc.stdout, out), (proc.stderr, err)):
            assert pipe is not None  # both are PIPEs
            sel.register(pipe, selectors.EVENT_READ, (tail, pipe))
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                tail, pipe = key.data
                if data:
                    tail.add(data)
                else:
                    sel.unregister(pipe)
                    pipe.close()
    try:
        proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output and goes on
        return False
    return True


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def read_local(path: str, offset: int = 0, limit: int = MAX_READ, where: str = "this machine") -> bytes | None:
    """Host.read_bytes of a file on this machine: at most `limit` bytes from `offset`; None if
    it does not exist; b"" if it is no regular file."""
    # O_NONBLOCK: a FIFO the job put there would block open() (and `down`) until a writer came.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError as exc:  # a link loop, a file made unreadable: the instance's doing
        raise UnreadableFile(f"cannot read {path} on {where}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b""  # a FIFO, a device (/dev/zero): nothing of it is a file's content
        os.set_blocking(fd, True)
        return read_part(fh, offset, limit, st.st_size)


class LocalHost(Deadlines):
    """This machine playing the instance; `root` is the cluster's work directory."""

    def __init__(self, root: Path, command_timeout_s: float = COMMAND_TIMEOUT_S):
        self.root = str(root)
        self.command_timeout_s = command_timeout_s
        self.label = "local"
        self.local = True
        self.python = sys.executable
        # One tmux server per cluster root, so clusters (and test runs) never see each other's jobs.
        self.tmux_socket = "gpuctl-" + hashlib.sha1(self.root.encode()).hexdigest()[:12]

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None,
            cwd: bool = True, output_limit: int | None = MAX_OUTPUT, probe: bool = False) -> CommandResult:
        limit = self.deadline(timeout)
        try:
            # No root (yet, or any more: killing a removed cluster's tmux): this process's own.
            where = self.root if cwd and os.path.isdir(self.root) else None
            # A session of its own: past the deadline the whole group goes, not only the first process
            # (a `sh -c` whose tmux hangs would keep the pipes, and so this call, open).
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=where,
                                    start_new_session=limit is not None)
        except FileNotFoundError:
            if not check:  # as a shell says it: `exec` passes 127 through, as over SSH
                return CommandResult(argv=tuple(argv), returncode=127, stdout="",
                                     stderr=f"{argv[0]}: command not found\n")
            raise RemoteError(
                f"`{argv[0]}` is not installed on {self.label}", f"Install it (e.g. `apt-get install {argv[0]}`)."
            ) from None
        out, err = Tail(output_limit), Tail(output_limit)
        try:
            finished = _drain(proc, out, err, limit)
        except BaseException:  # Ctrl-C: the command goes with gpuctl
            if limit is None:
                proc.kill()  # the user's own command (exec), in gpuctl's group: it had the Ctrl-C too
                proc.wait()
            else:
                _kill_group(proc)
            raise
        if not finished:
            _kill_group(proc)
            if probe:
                return gave_up(argv, out, err, limit or 0)
            raise self.timed_out(shown(argv), limit or 0)
        # As text mode read it before (universal newlines): a command's \r\n is one line end.
        res = CommandResult(argv=tuple(argv), returncode=proc.returncode, stdout=_newlines(out.text()),
                            stderr=_newlines(err.text()), dropped=out.dropped + err.dropped)
        return check_result(res, self.label) if check else res

    def file_size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # a link loop the instance made: as over SSH
            raise UnreadableFile(f"cannot look at {path} on {self.label}: {exc.strerror}") from None

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_READ) -> bytes | None:
        return read_local(path, offset, limit, self.label)

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.write_bytes(path, text.encode("utf-8"), mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.write_chunks(path, (data,), mode)

    def write_chunks(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{unique_suffix()}.tmp")  # concurrent writers
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
            os.chmod(tmp, mode)
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        return push_local(src, Path(dest), progress=progress)

    def link_tree(self, src: str, dest: str) -> None:
        link_local(Path(src), Path(dest))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def pull_tree(self, path: str, local: Path, leave_out: tuple[str, ...] = ()) -> tuple[int, tuple[str, ...]]:
        if not os.path.isdir(path):
            return 0, ()
        return pull_walk(LocalFiles(), path, local, leave_out)

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        if command is None:
            return [os.environ.get("SHELL", "/bin/sh")], self.root
        return ["/bin/sh", "-c", command], self.root

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        return None

    def close(self) -> None:
        pass
