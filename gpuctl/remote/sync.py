"""Incremental project push: what to send, what to skip, what to delete.

A push compares the project's files (size, mtime) with the manifest of the previous push kept in
the destination, so an unchanged project copies nothing and a one-file change copies that file.
Only files gpuctl itself pushed before are ever deleted: outputs a job wrote next to the code
(checkpoints, logs) survive the next push.

What is skipped follows git: the .gitignore files at every level (their patterns compiled by
pathspec, a well-kept gitignore library), then the project's top-level .gpuctlignore, which can
add patterns or `!`-re-include. A `progress` callback hears how a long push goes.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import shlex
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from gpuctl.remote.ignore import DEFAULT_IGNORES, MANIFEST, IgnoreRules  # noqa: F401  (re-exported)
from gpuctl.remote.tar_push import tar_push
from gpuctl.types import SyncStats

Progress = Callable[[str], None]


def encode_manifest(files: dict[str, tuple[int, int]]) -> bytes:
    """zlib-compressed JSON: a 3000-file manifest is ~40 KB instead of ~150 KB on every push."""
    return zlib.compress(json.dumps({k: list(v) for k, v in files.items()}).encode(), 6)


def decode_manifest(data: bytes | None) -> dict[str, tuple[int, int]]:
    """The previous push's files. The manifest lives on the instance, so it is untrusted: a path
    that is not plain and relative (`../victim`, `/etc/x`), or anything malformed, voids it all
    (a full push, and nothing deleted), never a deletion outside the destination."""
    try:
        raw = json.loads(zlib.decompress(data or b""))
    except (ValueError, zlib.error):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for rel, sig in raw.items():
        if not (_plain_relative(rel) and isinstance(sig, list) and len(sig) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in sig)):
            return {}
        out[rel] = (sig[0], sig[1])
    return out


def _plain_relative(rel: object) -> bool:
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\0" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def manifest_path(dest: str) -> str:
    """Beside the pushed tree, not in it: the job (and its data loaders) never see gpuctl's files."""
    dest = dest.rstrip("/")
    return posixpath.join(posixpath.dirname(dest), f".{posixpath.basename(dest)}{MANIFEST}")


def scan(src: Path, rules: IgnoreRules, progress: Progress | None = None,
         skipped: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Relative POSIX path -> (size, mtime_ns) of every file to push; ignored dirs are pruned.
    A scan that takes over a second reports to `progress` every 500 files.

    Odd entries, one policy for every provider: a symbolic link (to a file or a directory) that
    stays inside the project is followed, its content pushed under the link's name; one that
    leaves the project, or leads nowhere, is skipped; so are FIFOs, sockets and devices. Each
    skip is added to `skipped` as "path: why"."""
    files: dict[str, tuple[int, int]] = {}
    skipped = [] if skipped is None else skipped
    root = os.path.realpath(src)
    # The real directories on the way down to each directory walked: a link to one of them is a
    # loop, also when two links lead into each other (a/b -> ../c, c/d -> ../a).
    above: dict[str, frozenset[str]] = {str(src): frozenset({root})}
    t0, total = time.monotonic(), 0
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        base = os.path.relpath(dirpath, src)
        base = "" if base == "." else base.replace(os.sep, "/") + "/"
        ancestors = above.pop(dirpath, frozenset({root}))
        kept = []
        for d in sorted(dirnames):
            if rules.ignored(base + d, True):
                continue
            real = os.path.realpath(os.path.join(dirpath, d))
            if not path_inside(real, root):
                skipped.append(f"{base + d}/: a link to a directory outside the project")
            elif real in ancestors or any(path_inside(a, real) for a in ancestors):
                skipped.append(f"{base + d}/: a link back to a directory it is in (a loop)")
            else:
                kept.append(d)
                above[os.path.join(dirpath, d)] = ancestors | {real}
        dirnames[:] = kept
        for name in filenames:
            rel = base + name
            if rules.ignored(rel, False):
                continue
            path = os.path.join(dirpath, name)
            why = _odd(path, root)
            if why:
                skipped.append(f"{rel}: {why}")
                continue
            st = os.stat(path)
            files[rel] = (st.st_size, st.st_mtime_ns)
            total += st.st_size
            if progress is not None and len(files) % 500 == 0 and time.monotonic() - t0 >= 1.0:
                progress(f"scanning: {len(files):,} files ({_size(total)}) so far")
    return files


def unique_suffix() -> str:
    """For temporary names: two pushes to one place at once must not share one (issue 11)."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def path_inside(real: str, root: str) -> bool:
    """`real` is `root` or below it (both already resolved)."""
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _odd(path: str, root: str) -> str:
    """Why a directory entry is not pushed ("" if it is)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError as exc:
            return "a link that leads round in a loop" if exc.errno == errno.ELOOP else "a link that leads nowhere"
        if not path_inside(os.path.realpath(path), root):
            return "a link to a file outside the project"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    return ""


PROGRESS_EVERY_S = 1.0


class _Meter:
    """Passes progress lines on at most once per PROGRESS_EVERY_S (the first at once), so a caller
    can print each line as it is, terminal or not; `final` always goes out."""

    def __init__(self, progress: Progress | None, clock: Callable[[], float] = time.monotonic):
        self.on, self._out, self._every, self._clock = progress is not None, progress, PROGRESS_EVERY_S, clock
        self._last: float | None = None

    def due(self) -> bool:
        return self.on and (self._last is None or self._clock() - self._last >= self._every)

    def __call__(self, line: str) -> None:
        if self.due():
            self._last = self._clock()
            self._out(line)

    def final(self, line: str) -> None:
        if self.on:
            self._out(line)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{_size(nbytes / seconds)}/s" if seconds > 0 else "-"


def _scanned(meter: _Meter, current: dict[str, tuple[int, int]]) -> None:
    meter(f"scanned {len(current):,} files ({_size(sum(size for size, _ in current.values()))})")


def _done(meter: _Meter, stats: SyncStats) -> SyncStats:
    if stats.files_copied == stats.files_deleted == 0:
        meter.final(f"up to date: {stats.files_total:,} files unchanged ({stats.seconds:.1f} s)")
    else:
        meter.final(f"pushed {stats.files_copied:,} of {stats.files_total:,} files, {_size(stats.bytes_copied)} "
                    f"in {stats.seconds:.1f} s ({_rate(stats.bytes_copied, stats.seconds)}), "
                    f"{stats.files_deleted:,} deleted")
    return stats


def push_local(src: Path, dest: Path, progress: Progress | None = None) -> SyncStats:
    """Mirror `src` into `dest` on this filesystem, copying only what changed since the last push.
    `progress` gets short lines (files, bytes, rate), at most one a second, then a final one."""
    t0 = time.perf_counter()
    meter = _Meter(progress)
    skipped: list[str] = []
    current = scan(src, IgnoreRules.for_project(src), meter, skipped)
    _scanned(meter, current)
    dest.mkdir(parents=True, exist_ok=True)
    manifest = Path(manifest_path(str(dest)))
    previous = decode_manifest(manifest.read_bytes() if manifest.exists() else None)

    todo = [(rel, sig) for rel, sig in current.items() if not (
        previous.get(rel) == sig and (dest / rel).is_file() and (dest / rel).stat().st_size == sig[0])]
    want = sum(sig[0] for _, sig in todo)
    copied = nbytes = 0
    t1 = time.perf_counter()
    for rel, sig in todo:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{unique_suffix()}.gpuctl-tmp")
        shutil.copy2(src / rel, tmp)
        os.replace(tmp, target)  # atomic: a job reading the file never sees half of it
        copied += 1
        nbytes += sig[0]
        if meter.due():
            meter(f"sent {copied:,}/{len(todo):,} files, {_size(nbytes)} of {_size(want)}, "
                  f"{_rate(nbytes, time.perf_counter() - t1)}")

    deleted = 0
    for rel in previous.keys() - current.keys():
        try:
            (dest / rel).unlink()
            deleted += 1
        except FileNotFoundError:
            pass

    tmp_manifest = manifest.with_name(f"{manifest.name}.{unique_suffix()}.tmp")
    tmp_manifest.write_bytes(encode_manifest(current))
    os.replace(tmp_manifest, manifest)
    return _done(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=nbytes,
                                  files_deleted=deleted, seconds=time.perf_counter() - t0, skipped=tuple(skipped)))


def _remote_manifest(host, dest: str) -> dict[str, tuple[int, int]]:
    return decode_manifest(host.read_bytes(manifest_path(dest)))


# What the remote shell says when it cannot run rsync at all.
REMOTE_RSYNC_MISSING = re.compile(r"rsync: (command )?not found|rsync: Permission denied")


def _disk_full(host, dest: str) -> str:
    """'No space left on device (...)' when the destination's filesystem is (nearly) full."""
    res = host.run(["df", "-Pk", dest], check=False)
    try:
        fields = res.stdout.strip().splitlines()[-1].split()
        size_kb, avail_kb = int(fields[1]), int(fields[3])
    except (IndexError, ValueError):
        return ""
    if avail_kb < max(1024, size_kb // 100):
        return f"No space left on device ({avail_kb} KB free of {size_kb} KB where {dest} lives)"
    return ""


def _disk_hint(text: str) -> str:
    return ("The instance's disk is full: free space (`gpuctl exec -- df -h`) or use a bigger disk."
            if "No space left" in text or "ENOSPC" in text else "Rerun with --debug for the whole output.")


@lru_cache(maxsize=1)
def _rsync_has_progress2() -> bool:
    """--info=progress2 came with rsync 3.1; macOS ships 2.6.9 (or openrsync, "2.6.9 compatible")."""
    try:
        out = subprocess.run(["rsync", "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    m = re.search(r"version (\d+)\.(\d+)", out)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (3, 1)


# "  1,238,099  99%  1.23MB/s  0:00:00 (xfr#202, to-chk=0/204)"; the parenthesis only once a file is done.
_PROGRESS2 = re.compile(r"^\s*([\d,.]+)\s+\d+%\s+\S+\s+[\d:]+(?:\s+\(xfr#(\d+), (?:ir|to)-chk=(\d+)/(\d+)\))?")


def _progress2_line(m: re.Match[str], seconds: float) -> str:
    """A human line for one rsync --info=progress2 update."""
    nbytes = int(re.sub(r"[,.]", "", m.group(1)))
    text = f"sent {int(m.group(2) or 0):,} files, {_size(nbytes)}, {_rate(nbytes, seconds)}"
    if m.group(3):
        left, listed = int(m.group(3)), int(m.group(4))
        text += f" ({listed - left:,}/{listed:,} checked)"  # rsync's list counts directories too
    return text


def _pdeathsig() -> Callable[[], None] | None:
    """For Popen's preexec_fn on Linux: the child gets SIGTERM when gpuctl dies. Without it a
    `kill -9` of gpuctl mid-push left rsync uploading on for ~40 s (issue 11). prctl is looked up
    here, in the parent: between fork and exec the child must not import anything (other threads,
    the heartbeat's, may hold the import lock)."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _rsync(host, src: Path, dest: str, current: dict[str, tuple[int, int]], meter: _Meter) -> tuple[int, str, str]:
    """Run rsync, turning its progress into `meter` lines as they come; (exit code, stdout, stderr)."""
    # -L: a link the scan kept (it stays inside the project) goes as its content, as on every provider.
    argv = ["rsync", "-a", "-L", "--stats", "--files-from=-", "--from0", "-e", shlex.join(host.ssh_argv())]
    if meter.on and _rsync_has_progress2():
        argv.append("--info=progress2")
    argv += [f"{src}/", f"{host.ep.user}@{_rsync_host(host.ep.host)}:{dest}/"]
    # The file list and stderr go through files, not pipes: nothing stalls while stdout is read live.
    with tempfile.TemporaryFile() as listing, tempfile.TemporaryFile() as errors:
        listing.write(b"\0".join(os.fsencode(rel) for rel in current))
        listing.seek(0)
        proc = subprocess.Popen(argv, stdin=listing, stdout=subprocess.PIPE, stderr=errors, preexec_fn=_pdeathsig())
        kept: list[str] = []
        t0, pending = time.perf_counter(), b""
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):  # returns whatever rsync has written
                *lines, pending = re.split(rb"[\r\n]", pending + chunk)  # progress2 ends its lines with \r
                for raw in lines:
                    line = raw.decode("utf-8", "replace")
                    if not (m := _PROGRESS2.match(line)):
                        kept.append(line)
                    elif meter.due():
                        meter(_progress2_line(m, time.perf_counter() - t0))
            kept.append(pending.decode("utf-8", "replace"))
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.stdout.close()
        errors.seek(0)
        return code, "\n".join(kept), errors.read().decode("utf-8", "replace").strip()


def push_remote(host, src: Path, dest: str, progress: Progress | None = None) -> SyncStats:
    """Mirror `src` to `dest` on an SSH host: rsync over SSH where both ends have it, else one tar
    stream over the existing connection (tar_push.py). Each file lands whole (both write a temporary
    file and rename it), the manifest is written last, and only files gpuctl pushed before are deleted.
    Besides rsync's own connection, a push costs SFTP requests only: no remote shell.
    `progress` gets short lines (files, bytes, rate), at most one a second, then a final one."""
    from gpuctl.errors import RemoteError

    t0 = time.perf_counter()
    meter = _Meter(progress)
    skipped: list[str] = []
    current = scan(src, IgnoreRules.for_project(src), meter, skipped)
    _scanned(meter, current)
    host.makedirs(dest)
    previous = _remote_manifest(host, dest)
    copied = sent = -1
    if host.has_rsync is not False and shutil.which("rsync"):
        # rsync's own quick check (size + mtime) decides what to send; --files-from keeps it to
        # exactly the files the ignore rules allow.
        code, out, err = _rsync(host, src, dest, current, meter)
        if code in (12, 126, 127) and REMOTE_RSYNC_MISSING.search(err):
            host.has_rsync = False  # the host has none: tar from now on
        elif code != 0:
            lines = err.splitlines() or [""]
            # rsync ends with a generic "error in file IO"; the cause is on an earlier line, or
            # lost when the receiver dies first: then ask the disk itself.
            cause = next((ln for ln in lines if "No space left" in ln), "") or _disk_full(host, dest) or lines[-1]
            raise RemoteError(f"push to {host.label} failed (rsync exit {code}): {cause.strip()}",
                              _disk_hint(cause + err))
        else:
            host.has_rsync = True
            copied = _stat(out, "Number of regular files transferred")
            sent = _stat(out, "Total bytes sent")
    if copied < 0:
        changed = [rel for rel, sig in current.items() if previous.get(rel) != sig]
        code, sent, err = tar_push(host, src, dest, changed, meter) if changed else (0, 0, "")
        if code != 0:
            cause = next((ln for ln in err.splitlines() if "No space left" in ln or ln.startswith("gpuctl:")),
                         "") or _disk_full(host, dest) or (err.strip().splitlines() or [f"exit {code}"])[-1]
            raise RemoteError(f"push to {host.label} failed (tar stream): {cause.strip()[-300:]}", _disk_hint(err))
        copied = len(changed)
    gone = sorted(previous.keys() - current.keys())
    for i in range(0, len(gone), 500):  # batched: one command per 500 deletions, not one per file
        host.run(["rm", "-f", "--", *[f"{dest}/{rel}" for rel in gone[i : i + 500]]])
    # rsync needs the manifest only for deletions (the set of paths); tar needs the signatures.
    if host.has_rsync is False or previous.keys() != current.keys():
        host.write_bytes(manifest_path(dest), encode_manifest(current))
    return _done(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=sent,
                                  files_deleted=len(gone), seconds=time.perf_counter() - t0, skipped=tuple(skipped)))


def _rsync_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _stat(text: str, label: str) -> int:
    m = re.search(re.escape(label) + r":\s*([\d,.]+)", text)
    return int(m.group(1).replace(",", "").replace(".", "")) if m else 0
