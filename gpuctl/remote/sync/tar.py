"""The push for hosts without rsync: one tar stream over the open SSH connection, written as it is
read (memory flat whatever the tree's size), unpacked on the host by a few lines of Python that
write each file under a temporary name and rename it into place. An interrupted push leaves every
file either as it was or whole and new, never truncated (a tar built whole in memory took 172 s for
128 MB, and one extracted in place leaves half-written files).

The host is python3's: the ssh provider checks for it at `up`, and every AMI gpuctl uses has it.
"""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path
from typing import IO, Any, Callable, cast

from gpuctl.errors import ProjectError
from gpuctl.remote.host import SshShell

# Runs on the host: python3 -c UNPACK DEST. Names come from this machine's scan, but the host
# checks them anyway (relative, no `..`, inside DEST after symlinks) and takes regular files only.
UNPACK = r'''
import os, shutil, sys, tarfile
dest = os.path.realpath(sys.argv[1])
tmp, n = None, 0
def refuse(name, why):
    sys.stderr.write("gpuctl: refusing %r in the push: %s\n" % (name, why))
    sys.exit(3)
try:
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                refuse(m.name, "not a plain relative path")
            if not m.isreg():
                refuse(m.name, "not a regular file")
            folder = os.path.join(dest, *parts[:-1])
            os.makedirs(folder, exist_ok=True)
            real = os.path.realpath(folder)
            if real != dest and not real.startswith(dest + os.sep):
                refuse(m.name, "its folder leads out of the destination")
            tmp = os.path.join(folder, ".%s.%d.gpuctl-tmp" % (parts[-1], os.getpid()))
            with open(tmp, "wb") as fh:
                shutil.copyfileobj(tar.extractfile(m), fh, 1 << 20)
            os.chmod(tmp, m.mode & 0o777)
            os.utime(tmp, (m.mtime, m.mtime))
            os.replace(tmp, os.path.join(folder, parts[-1]))
            tmp, n = None, n + 1
finally:
    if tmp:
        try:
            os.remove(tmp)
        except OSError:
            pass
print(n)
'''


class _Counting:
    """Passes writes on, counting bytes and telling `tick` (for progress) after each."""

    def __init__(self, stream: Any, tick: Callable[[int], None]):
        self.stream, self.tick, self.sent = stream, tick, 0

    def write(self, data: bytes) -> int:
        self.stream.write(data)
        self.sent += len(data)
        self.tick(self.sent)
        return len(data)


def tar_push(host: SshShell, src: Path, dest: str, changed: list[str], progress: Callable[[str], None]) -> tuple[int, int, str]:
    """Send `changed` (paths relative to `src`) to `dest`; (exit code, bytes sent, stderr)."""
    want = sum(os.path.getsize(src / rel) for rel in changed)
    t0 = time.perf_counter()

    def tick(sent: int) -> None:
        rate = sent / max(time.perf_counter() - t0, 1e-6)
        progress(f"sent {sent / 1e6:,.1f} of {want / 1e6:,.1f} MB as a tar stream, {rate / 1e6:,.1f} MB/s")

    counting: _Counting | None = None

    def feed(stream: Any) -> None:
        nonlocal counting
        counting = _Counting(stream, tick)
        # 1 MB blocks: one SSH write per block, not one per 10 KB tar record.
        # cast: a "w|" stream only ever writes (typeshed asks any fileobj for read/seek/tell too).
        with tarfile.open(fileobj=cast("IO[bytes]", counting), mode="w|", format=tarfile.PAX_FORMAT, bufsize=1 << 20) as tar:
            for rel in changed:
                try:
                    with open(src / rel, "rb") as fh:  # follows a link the scan allowed: its content goes
                        st = os.fstat(fh.fileno())
                        info = tarfile.TarInfo(rel)
                        info.size, info.mtime, info.mode = st.st_size, st.st_mtime, st.st_mode & 0o777
                        tar.addfile(info, fh)
                except OSError as exc:  # it vanished, or shrank ("unexpected end of data")
                    raise ProjectError(f"{rel} changed while it was pushed ({exc.strerror or exc})",
                                       "Push again once nothing writes to the project.") from None

    res = host.run_feeding(["python3", "-c", UNPACK, dest], feed)
    return res.returncode, counting.sent if counting else 0, res.stderr
