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
import shlex
import shutil
import stat
import time
import zlib
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from gpuctl.files import unique_suffix
from gpuctl.errors import ProjectError, RemoteError
from gpuctl.model.records import SyncStats
from gpuctl.remote.sync.ignore import DEFAULT_IGNORES, MANIFEST, IgnoreRules, left_out_note  # noqa: F401  (re-exported)
from gpuctl.remote.sync.private import Private

Progress = Callable[[str], None]


def encode_manifest(files: dict[str, tuple[int, int]]) -> bytes:
    """zlib-compressed JSON: a 3000-file manifest is ~40 KB instead of ~150 KB on every push."""
    raw = json.dumps({k: list(v) for k, v in files.items()}).encode()
    if len(raw) > MANIFEST_MAX:  # the next push would not believe it

        raise ProjectError(f"the project has {len(files):,} files: more than a push keeps track of "
                           f"({MANIFEST_MAX >> 20} MiB of names)", "Leave out what the job does not need "
                           "(.gpuctlignore), or pack small files into archives.")
    return zlib.compress(raw, 6)


def decode_manifest(data: bytes | None) -> dict[str, tuple[int, int]]:
    """The previous push's files. The manifest lives on the instance, so it is untrusted: a path
    that is not plain and relative (`../victim`, `/etc/x`), or anything malformed, voids it all
    (a full push, and nothing deleted), never a deletion outside the destination."""
    try:
        raw = json.loads(inflate(data or b"", MANIFEST_MAX))
    except (ValueError, zlib.error, RecursionError):  # ManifestTooLarge is no ValueError: it is said
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


# What a manifest may expand to: ~300,000 files. A larger one is not believed (a 1.5 MB zlib bomb
# would expand to gigabytes), and decoding stops there.
MANIFEST_MAX = 16 << 20


class ManifestTooLarge(Exception):
    """The previous push's manifest expands past MANIFEST_MAX."""


def inflate(data: bytes, limit: int) -> bytes:
    """zlib data expanded to at most `limit` bytes (ManifestTooLarge past it): never more held."""
    z = zlib.decompressobj()
    out = z.decompress(data, limit + 1)
    if len(out) > limit or z.unconsumed_tail:
        raise ManifestTooLarge(f"expands past {limit >> 20} MiB")
    return out


def previous_manifest(data: bytes | None, where: str, path: str) -> dict[str, tuple[int, int]]:
    """decode_manifest, with a manifest too large to believe a clear error (RemoteError)."""
    try:
        return decode_manifest(data)
    except ManifestTooLarge as exc:
        raise RemoteError(f"the previous push's manifest {path} on {where} {exc} (over ~300,000 files, or not "
                          "written by gpuctl)", f"Remove it to push everything afresh: gpuctl exec -- rm -f "
                          f"{shlex.quote(path)}; a project that large needs a .gpuctlignore.") from None


def _plain_relative(rel: object) -> bool:
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\0" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def manifest_path(dest: str) -> str:
    """Beside the pushed tree, not in it: the job (and its data loaders) never see gpuctl's files."""
    dest = dest.rstrip("/")
    return posixpath.join(posixpath.dirname(dest), f".{posixpath.basename(dest)}{MANIFEST}")


def scan(src: Path, rules: IgnoreRules, progress: Progress | None = None,
         skipped: list[str] | None = None, refused: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Relative POSIX path -> (size, mtime_ns) of every file to push; ignored dirs are pruned.
    A scan that takes over a second reports to `progress` every 500 files.

    Odd entries, one policy for every provider: a symbolic link (to a file or a directory) that
    stays inside the project is followed, its content pushed under the link's name; one that
    leaves the project, or leads nowhere, is skipped; so are FIFOs, sockets and devices. Each
    skip is added to `skipped` as "path: why".

    What is private (private.py: the gpuctl home, ~/.ssh, ~/.aws), by its real path, is never
    pushed, whatever the ignore rules say: each such entry is added to `refused` as "path: what";
    a `src` that is private itself is a ProjectError."""
    files: dict[str, tuple[int, int]] = {}
    skipped = [] if skipped is None else skipped
    refused = [] if refused is None else refused
    root = os.path.realpath(src)
    private = Private()
    private.check_root(root)
    # The real directories on the way down to each directory walked: a link to one of them is a
    # loop, also when two links lead into each other (a/b -> ../c, c/d -> ../a).
    above: dict[str, frozenset[str]] = {str(src): frozenset({root})}
    t0, total = time.monotonic(), 0
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        base = os.path.relpath(dirpath, src)
        base = "" if base == "." else base.replace(os.sep, "/") + "/"
        ancestors = above.pop(dirpath, frozenset({root}))
        real_dir = os.path.realpath(dirpath)
        kept = []
        for d in sorted(dirnames):
            if rules.ignored(base + d, True):
                continue
            real = os.path.realpath(os.path.join(dirpath, d))
            if what := private.what(real):
                refused.append(f"{base + d}/: {what}")
            elif not path_inside(real, root):
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
            # A file that is no link, in a directory already found not private, can only be one itself.
            st = os.lstat(path)
            link = stat.S_ISLNK(st.st_mode)
            if what := private.what(os.path.realpath(path) if link else os.path.join(real_dir, name), exact=not link):
                refused.append(f"{rel}: {what}")
                continue
            why = _odd(path, root, st)
            if why:
                skipped.append(f"{rel}: {why}")
                continue
            st = os.stat(path) if link else st
            files[rel] = (st.st_size, st.st_mtime_ns)
            total += st.st_size
            if progress is not None and len(files) % 500 == 0 and time.monotonic() - t0 >= 1.0:
                progress(f"scanning: {len(files):,} files ({size_text(total)}) so far")
    return files


def path_inside(real: str, root: str) -> bool:
    """`real` is `root` or below it (both already resolved)."""
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _odd(path: str, root: str, st: os.stat_result) -> str:
    """Why a directory entry (`st`: its lstat) is not pushed ("" if it is)."""
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


class Meter:
    """Passes progress lines on at most once per PROGRESS_EVERY_S (the first at once), so a caller
    can print each line as it is, terminal or not; `final` always goes out."""

    def __init__(self, progress: Progress | None, clock: Callable[[], float] = time.monotonic):
        self.on, self._out, self._every, self._clock = progress is not None, progress, PROGRESS_EVERY_S, clock
        self._last: float | None = None

    def due(self) -> bool:
        return self._out is not None and (self._last is None or self._clock() - self._last >= self._every)

    def __call__(self, line: str) -> None:
        if self._out is not None and self.due():
            self._last = self._clock()
            self._out(line)

    def final(self, line: str) -> None:
        if self._out is not None:
            self._out(line)


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def rate_text(nbytes: int, seconds: float) -> str:
    return f"{size_text(nbytes / seconds)}/s" if seconds > 0 else "-"


def scanned(meter: Meter, current: dict[str, tuple[int, int]]) -> None:
    meter(f"scanned {len(current):,} files ({size_text(sum(size for size, _ in current.values()))})")


def finished(meter: Meter, stats: SyncStats) -> SyncStats:
    if stats.files_copied == stats.files_deleted == 0:
        meter.final(f"up to date: {stats.files_total:,} files unchanged ({stats.seconds:.1f} s)")
    else:
        meter.final(f"pushed {stats.files_copied:,} of {stats.files_total:,} files, {size_text(stats.bytes_copied)} "
                    f"in {stats.seconds:.1f} s ({rate_text(stats.bytes_copied, stats.seconds)}), "
                    f"{stats.files_deleted:,} deleted")
    return stats


def begin(src: Path, progress: Progress | None) -> tuple[Meter, dict[str, tuple[int, int]], list[str], list[str]]:
    """How every push starts: its meter, the project's files under its ignore rules (said on the
    meter), what the scan skipped, and what it refused (private)."""
    meter = Meter(progress)
    skipped: list[str] = []
    refused: list[str] = []
    rules = IgnoreRules.for_project(src)
    current = scan(src, rules, meter, skipped, refused)
    scanned(meter, current)
    if note := left_out_note(src, rules):  # a few MB the project's own rules keep back: said, with the rule
        meter.final(note)
    return meter, current, skipped, refused


def push_local(src: Path, dest: Path, progress: Progress | None = None) -> SyncStats:
    """Mirror `src` into `dest` on this filesystem, copying only what changed since the last push.
    `progress` gets short lines (files, bytes, rate), at most one a second, then a final one."""
    t0 = time.perf_counter()
    meter, current, skipped, refused = begin(src, progress)
    dest.mkdir(parents=True, exist_ok=True)
    manifest = Path(manifest_path(str(dest)))
    with open(manifest, "rb") if manifest.is_file() else nullcontext() as fh:
        previous = previous_manifest(fh.read(MANIFEST_MAX) if fh else None, "this machine", str(manifest))

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
            meter(f"sent {copied:,}/{len(todo):,} files, {size_text(nbytes)} of {size_text(want)}, "
                  f"{rate_text(nbytes, time.perf_counter() - t1)}")

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
    return finished(meter, SyncStats(files_total=len(current), files_copied=copied, bytes_copied=nbytes,
                                  files_deleted=deleted, seconds=time.perf_counter() - t0, skipped=tuple(skipped),
                                  refused=tuple(refused)))
