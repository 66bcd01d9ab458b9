"""The push to an SSH host: rsync over SSH where both ends have it (its progress turned into
sync/__init__.py's meter lines), else one tar stream over the existing connection (tar.py); then
the deletions and the manifest. What to send is sync/__init__.py's scan, as on every provider."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from gpuctl.errors import RemoteError
from gpuctl.model.records import SyncStats
from gpuctl.remote.host import SshShell
from gpuctl.remote.sync import (
    MANIFEST_MAX,
    Meter,
    Progress,
    begin,
    encode_manifest,
    finished,
    manifest_path,
    previous_manifest,
    rate_text,
    size_text,
)
from gpuctl.remote.sync.tar import tar_push


def _remote_manifest(host: SshShell, dest: str) -> dict[str, tuple[int, int]]:
    path = manifest_path(dest)
    return previous_manifest(host.read_bytes(path, 0, MANIFEST_MAX), host.label, path)


RSYNC_TIMED_OUT = 30  # rsync's exit code for --timeout
# What the remote shell says when it cannot run rsync at all.
REMOTE_RSYNC_MISSING = re.compile(r"rsync: (command )?not found|rsync: Permission denied")


def _disk_full(host: SshShell, dest: str) -> str:
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
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (3, 1)


# "  1,238,099  99%  1.23MB/s  0:00:00 (xfr#202, to-chk=0/204)"; the parenthesis only once a file is done.
_PROGRESS2 = re.compile(r"^\s*([\d,.]+)\s+\d+%\s+\S+\s+[\d:]+(?:\s+\(xfr#(\d+), (?:ir|to)-chk=(\d+)/(\d+)\))?")


def _progress2_line(m: re.Match[str], seconds: float) -> str:
    """A human line for one rsync --info=progress2 update."""
    nbytes = int(re.sub(r"[,.]", "", m.group(1)))
    text = f"sent {int(m.group(2) or 0):,} files, {size_text(nbytes)}, {rate_text(nbytes, seconds)}"
    if m.group(3):
        left, listed = int(m.group(3)), int(m.group(4))
        text += f" ({listed - left:,}/{listed:,} checked)"  # rsync's list counts directories too
    return text


def _pdeathsig() -> Callable[[], None] | None:
    """For Popen's preexec_fn on Linux: the child gets SIGTERM when gpuctl dies. Without it a
    `kill -9` of gpuctl mid-push left rsync uploading on for ~40 s. prctl is looked up
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


def _rsync(host: SshShell, src: Path, dest: str, current: dict[str, tuple[int, int]], meter: Meter) -> tuple[int, str, str]:
    """Run rsync, turning its progress into `meter` lines as they come; (exit code, stdout, stderr)."""
    # -L: a link the scan kept (it stays inside the project) goes as its content, as on every provider.
    limit = host.deadline()
    # --timeout: a host that takes nothing for that long ends the push (rsync exits 30).
    argv = ["rsync", "-a", "-L", "--stats", "--files-from=-", "--from0", *([f"--timeout={max(1, round(limit))}"] if limit else []),
            "-e", shlex.join(host.ssh_argv())]
    if meter.on and _rsync_has_progress2():
        argv.append("--info=progress2")
    argv += [f"{src}/", f"{host.ep.user}@{rsync_host(host.ep.host)}:{dest}/"]
    # The file list and stderr go through files, not pipes: nothing stalls while stdout is read live.
    with tempfile.TemporaryFile() as listing, tempfile.TemporaryFile() as errors:
        listing.write(b"\0".join(os.fsencode(rel) for rel in current))
        listing.seek(0)
        proc = subprocess.Popen(argv, stdin=listing, stdout=subprocess.PIPE, stderr=errors, preexec_fn=_pdeathsig())
        assert proc.stdout is not None  # stdout=PIPE
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


def push_remote(host: SshShell, src: Path, dest: str, progress: Progress | None = None) -> SyncStats:
    """Mirror `src` to `dest` on an SSH host: rsync over SSH where both ends have it, else one tar
    stream over the existing connection (tar.py). Each file lands whole (both write a temporary
    file and rename it), the manifest is written last, and only files gpuctl pushed before are deleted.
    Besides rsync's own connection, a push costs SFTP requests only: no remote shell.
    `progress` gets short lines (files, bytes, rate), at most one a second, then a final one."""
    t0 = time.perf_counter()
    meter, current, skipped, refused = begin(src, progress)
    host.makedirs(dest)
    previous = _remote_manifest(host, dest)
    copied = sent = -1
    if host.has_rsync is not False and shutil.which("rsync"):
        # rsync's own quick check (size + mtime) decides what to send; --files-from keeps it to
        # exactly the files the ignore rules allow.
        code, out, err = _rsync(host, src, dest, current, meter)
        if code == RSYNC_TIMED_OUT:
            raise host.timed_out(f"rsync to {dest}", host.command_timeout_s)
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
    return finished(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=sent,
                                  files_deleted=len(gone), seconds=time.perf_counter() - t0, skipped=tuple(skipped),
                                  refused=tuple(refused)))


def rsync_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _stat(text: str, label: str) -> int:
    m = re.search(re.escape(label) + r":\s*([\d,.]+)", text)
    return int(m.group(1).replace(",", "").replace(".", "")) if m else 0
