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

import io
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from gpuctl.remote.ignore import DEFAULT_IGNORES, MANIFEST, IgnoreRules  # noqa: F401  (re-exported)
from gpuctl.types import SyncStats

Progress = Callable[[str], None]


def encode_manifest(files: dict[str, tuple[int, int]]) -> bytes:
    """zlib-compressed JSON: a 3000-file manifest is ~40 KB instead of ~150 KB on every push."""
    return zlib.compress(json.dumps({k: list(v) for k, v in files.items()}).encode(), 6)


def decode_manifest(data: bytes | None) -> dict[str, tuple[int, int]]:
    try:
        return {k: tuple(v) for k, v in json.loads(zlib.decompress(data or b"")).items()}
    except (ValueError, zlib.error):
        return {}


def manifest_path(dest: str) -> str:
    """Beside the pushed tree, not in it: the job (and its data loaders) never see gpuctl's files."""
    dest = dest.rstrip("/")
    return posixpath.join(posixpath.dirname(dest), f".{posixpath.basename(dest)}{MANIFEST}")


def scan(src: Path, rules: IgnoreRules, progress: Progress | None = None) -> dict[str, tuple[int, int]]:
    """Relative POSIX path -> (size, mtime_ns) of every file to push; ignored dirs are pruned.
    A scan that takes over a second reports to `progress` every 500 files."""
    files: dict[str, tuple[int, int]] = {}
    t0, total = time.monotonic(), 0
    for dirpath, dirnames, filenames in os.walk(src):
        base = os.path.relpath(dirpath, src)
        base = "" if base == "." else base.replace(os.sep, "/") + "/"
        dirnames[:] = sorted(d for d in dirnames if not rules.ignored(base + d, True))
        for name in filenames:
            rel = base + name
            if rules.ignored(rel, False):
                continue
            st = os.stat(os.path.join(dirpath, name))
            files[rel] = (st.st_size, st.st_mtime_ns)
            total += st.st_size
            if progress is not None and len(files) % 500 == 0 and time.monotonic() - t0 >= 1.0:
                progress(f"scanning: {len(files):,} files ({_size(total)}) so far")
    return files


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
    current = scan(src, IgnoreRules.for_project(src), meter)
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
        tmp = target.with_name(f".{target.name}.gpuctl-tmp")
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

    tmp_manifest = manifest.with_suffix(".tmp")
    tmp_manifest.write_bytes(encode_manifest(current))
    os.replace(tmp_manifest, manifest)
    return _done(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=nbytes,
                                  files_deleted=deleted, seconds=time.perf_counter() - t0))


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


def _rsync(host, src: Path, dest: str, current: dict[str, tuple[int, int]], meter: _Meter) -> tuple[int, str, str]:
    """Run rsync, turning its progress into `meter` lines as they come; (exit code, stdout, stderr)."""
    argv = ["rsync", "-a", "--stats", "--files-from=-", "--from0", "-e", shlex.join(host.ssh_argv())]
    if meter.on and _rsync_has_progress2():
        argv.append("--info=progress2")
    argv += [f"{src}/", f"{host.ep.user}@{_rsync_host(host.ep.host)}:{dest}/"]
    # The file list and stderr go through files, not pipes: nothing stalls while stdout is read live.
    with tempfile.TemporaryFile() as listing, tempfile.TemporaryFile() as errors:
        listing.write(b"\0".join(os.fsencode(rel) for rel in current))
        listing.seek(0)
        proc = subprocess.Popen(argv, stdin=listing, stdout=subprocess.PIPE, stderr=errors)
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
    stream over the existing connection. Each file lands whole (rsync writes a temporary file
    and renames it), the manifest is written last, and only files gpuctl pushed before are deleted.
    Besides rsync's own connection, a push costs SFTP requests only: no remote shell.
    `progress` gets short lines (files, bytes, rate), at most one a second, then a final one."""
    from gpuctl.errors import RemoteError

    t0 = time.perf_counter()
    meter = _Meter(progress)
    current = scan(src, IgnoreRules.for_project(src), meter)
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
        want = sum(current[rel][0] for rel in changed)
        buf, packed = io.BytesIO(), 0
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i, rel in enumerate(changed, 1):
                tar.add(str(src / rel), arcname=rel, recursive=False)
                packed += current[rel][0]
                if meter.due():
                    meter(f"packed {i:,}/{len(changed):,} files, {_size(packed)} of {_size(want)}")
        payload = buf.getvalue()
        meter(f"sending {len(changed):,} files, {_size(len(payload))} as one tar stream")
        res = host.run(["tar", "-C", dest, "-xf", "-"], check=False, stdin=payload)
        if res.returncode != 0:
            raise RemoteError(f"push to {host.label} failed (tar): {res.stderr.strip()[-300:]}", _disk_hint(res.stderr))
        copied, sent = len(changed), len(payload)
    gone = sorted(previous.keys() - current.keys())
    for i in range(0, len(gone), 500):  # batched: one command per 500 deletions, not one per file
        host.run(["rm", "-f", "--", *[f"{dest}/{rel}" for rel in gone[i : i + 500]]])
    # rsync needs the manifest only for deletions (the set of paths); tar needs the signatures.
    if host.has_rsync is False or previous.keys() != current.keys():
        host.write_bytes(manifest_path(dest), encode_manifest(current))
    return _done(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=sent,
                                  files_deleted=len(gone), seconds=time.perf_counter() - t0))


def _rsync_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _stat(text: str, label: str) -> int:
    m = re.search(re.escape(label) + r":\s*([\d,.]+)", text)
    return int(m.group(1).replace(",", "").replace(".", "")) if m else 0
