"""Bringing a run's files back from an instance, which is untrusted input: the names it
lists and the links it holds decide nothing outside the local target.

One walk serves every host (SFTP over the open connection, or this machine's own files for the
local provider): a name that is not one plain path component is skipped; a symbolic link is
recreated only when it stays inside the run's tree (relative, never above its top), else
skipped; so are FIFOs, sockets and devices. Each skip is reported as "path: why". rsync, where
both ends have it, applies the same rules (`--safe-links --no-D`); what it says it skipped is read
back from its output (`rsync_left_out`), so both paths list what they left out. The names come
from the instance: `left_out` strips control characters and bounds the list before anyone sees it.

Nothing pulled gets more than the user asked for: no setuid, setgid or sticky bit, no
owner but the user running gpuctl, and no permission the instance's file lacks or the user's
umask takes away (`pulled_mode`; rsync gets the same rule as `--chmod`, `rsync_chmod`). The owner
can always read and write what was pulled, and enter its directories.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from gpuctl.errors import RemoteError
from gpuctl.remote.sync import path_inside

MAX_LEFT_OUT = 200  # entries listed; a run with more says how many more
MAX_ENTRY_CHARS = 300


def printable(text: str) -> str:
    """`text` without control characters (an instance's file names may hold escape sequences)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def left_out(entries: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """What a pull left out, fit to show: printable, each entry and the list bounded."""
    kept = [_shorter(printable(e)) for e in entries[:MAX_LEFT_OUT]]
    if len(entries) > MAX_LEFT_OUT:
        kept.append(f"... and {len(entries) - MAX_LEFT_OUT} more entries left out")
    return tuple(kept)


# What rsync (--info=name1,nonreg1) says of what --safe-links and --no-D made it skip.
_RSYNC_UNSAFE = re.compile(r'^ignoring unsafe symlink "(.*)" -> "(.*)"$')
_RSYNC_NONREG = re.compile(r'^skipping non-regular file "(.*)"$')


def rsync_left_out(stdout: str) -> tuple[str, ...]:
    """The entries rsync's output says it skipped, as "path: why" like the SFTP walk's."""
    out = []
    for line in stdout.splitlines():
        if m := _RSYNC_UNSAFE.match(line):
            out.append(f"{m[1]}: a link leading out of the run ({m[2]})")
        elif m := _RSYNC_NONREG.match(line):
            out.append(f"{m[1]}: not a regular file")
    return left_out(out)


def current_umask() -> int:
    mask = os.umask(0o077)  # the only way to read it is to set it: set back at once
    os.umask(mask)
    return mask


def pulled_mode(remote_mode: int, is_dir: bool, umask: int) -> int:
    """The mode a pulled file or directory gets here: the instance's permission bits (never its
    setuid, setgid or sticky bit) less what the user's umask takes away, and always the owner's
    read and write (and enter, for a directory)."""
    return (remote_mode & 0o777 & ~umask) | (0o700 if is_dir else 0o600)


def rsync_chmod(umask: int) -> str:
    """`pulled_mode` as rsync's --chmod (with --perms: files pulled before are set again too)."""
    rule = ["ugo-st"]
    for who, shift in (("u", 6), ("g", 3), ("o", 0)):
        bits = "".join(c for c, b in (("r", 4), ("w", 2), ("x", 1)) if (umask >> shift) & b)
        if bits:
            rule.append(f"{who}-{bits}")
    return ",".join(rule + ["u+rw", "Du+x"])


def _shorter(entry: str) -> str:
    """An entry cut in its middle: the path's start and the reason at its end both stay."""
    if len(entry) <= MAX_ENTRY_CHARS:
        return entry
    return entry[:MAX_ENTRY_CHARS // 3] + "…" + entry[-(MAX_ENTRY_CHARS * 2 // 3 - 1):]


def plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def link_stays_inside(rel: str, target: str) -> bool:
    """A link at `rel` (relative to the tree's top) pointing at `target` stays in the tree. As
    rsync decides since CVE-2024-12088: `..` only at the start of the target, never after a name
    (`a/b/../..` could climb through another link), and never above the top."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    if ".." in parts[ups:]:
        return False
    return ups <= rel.count("/")  # as many levels up as the link sits below the top, at most


def _inside(path: Path, top: Path) -> bool:
    return path_inside(os.path.realpath(path), os.path.realpath(top))


def _clear(lpath: Path) -> None:
    """Make room for an entry: what an earlier pull left there goes (a link is never followed)."""
    if lpath.is_symlink() or lpath.is_file():
        lpath.unlink()
    elif lpath.is_dir():
        shutil.rmtree(lpath)


def pull_walk(fs: Any, top: str, local: Path, leave_out: tuple[str, ...] = ()) -> tuple[int, tuple[str, ...]]:
    """Copy the tree at `top` on `fs` (an SFTP client, or LocalFiles) into `local`, but for the
    top's entries named in `leave_out`; (regular files copied, skipped entries). Links are made last, once every file and directory is in place, so
    no listing order can make a write go through one. An entry whose path here would pass the
    system's limits (PATH_MAX, NAME_MAX) is skipped and named; any other failure is a RemoteError."""
    count = 0
    skipped: list[str] = []
    links: list[tuple[Path, str, str]] = []
    umask = current_umask()
    dir_modes: dict[str, int] = {}  # by path under the top ("a/b/"): the instance's mode, made safe
    local.mkdir(parents=True, exist_ok=True)
    stack = [(top, local, "")]
    while stack:
        rdir, ldir, rel_dir = stack.pop()
        with _too_long(skipped, rel_dir or ".") as ok:
            if ldir.is_symlink() or not _inside(ldir, local):
                skipped.append(f"{rel_dir or '.'}: a directory that is not one here")
                continue
            ldir.mkdir(mode=0o700, exist_ok=True)
            entries = fs.listdir_attr(rdir)
        if not ok:
            continue
        if rel_dir:  # the top is the caller's (pull made it)
            os.chmod(ldir, dir_modes[rel_dir])
        seen: set[str] = set()
        for entry in entries:
            name = entry.filename
            if not plain_name(name) or name in seen:
                skipped.append(f"{rel_dir}{name!r}: " + ("listed twice" if name in seen else "not a plain file name"))
                continue
            seen.add(name)
            if not rel_dir and name in leave_out:
                continue
            rpath, lpath, rel = posixpath.join(rdir, name), ldir / name, rel_dir + name
            mode = entry.st_mode or 0
            with _too_long(skipped, rel):
                if stat.S_ISLNK(mode):
                    target = fs.readlink(rpath)
                    if link_stays_inside(rel, target):
                        links.append((lpath, target, rel))
                    else:
                        skipped.append(f"{rel}: a link leading out of the run ({target})")
                elif stat.S_ISDIR(mode):
                    if lpath.is_symlink() or (lpath.exists() and not lpath.is_dir()):
                        _clear(lpath)
                    dir_modes[rel + "/"] = pulled_mode(mode, True, umask)
                    stack.append((rpath, lpath, rel + "/"))
                elif stat.S_ISREG(mode):
                    if lpath.is_symlink() or lpath.is_dir():
                        _clear(lpath)
                    _copy(fs, rpath, lpath, pulled_mode(mode, False, umask))
                    count += 1
                else:
                    skipped.append(f"{rel}: not a regular file")
    for lpath, target, rel in links:
        with _too_long(skipped, rel):
            if _inside(lpath.parent, local):
                _clear(lpath)
                lpath.symlink_to(target)
    return count, left_out(skipped)


class _Outcome:
    def __init__(self) -> None:
        self.ok = True

    def __bool__(self) -> bool:
        return self.ok


@contextmanager
def _too_long(skipped: list[str], rel: str) -> Iterator[_Outcome]:
    """An entry whose path here is past the system's limits is skipped and named (the instance
    chooses how deep its tree goes); any other OSError ends the pull as one clear error."""
    outcome = _Outcome()
    try:
        yield outcome
    except OSError as exc:
        outcome.ok = False
        if exc.errno == errno.ENAMETOOLONG:
            skipped.append(f"{rel}: its path here would be too long")
            return

        raise RemoteError(f"pull stopped at {printable(rel)[:MAX_ENTRY_CHARS]}: {exc.strerror or exc}",
                          "Check that the destination is writable and has room; pull again to go on.") from None


def _copy(fs: Any, rpath: str, lpath: Path, mode: int) -> None:
    """The file's bytes into `lpath`, which has `mode` from its first byte (never the wider mode
    the umask alone would give, not even while it is written); a file pulled before is set again."""
    fd = os.open(lpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fd, mode)
        fs.getfo(rpath, fh)


class LocalFiles:
    """This machine's files with the three calls pull_walk makes of an SFTP client."""

    class _Entry:
        def __init__(self, filename: str, st_mode: int):
            self.filename, self.st_mode = filename, st_mode

    def listdir_attr(self, path: str) -> list[Any]:
        return [self._Entry(e.name, e.stat(follow_symlinks=False).st_mode) for e in os.scandir(path)]

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def getfo(self, path: str, fh: Any) -> None:
        with open(path, "rb") as src:
            shutil.copyfileobj(src, fh)
