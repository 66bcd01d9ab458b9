"""Bringing a run's files back from an instance, which is untrusted input (issue 11): the names it
lists and the links it holds decide nothing outside the local target.

One walk serves every host (SFTP over the open connection, or this machine's own files for the
local provider): a name that is not one plain path component is skipped; a symbolic link is
recreated only when it stays inside the run's tree (relative, never above its top), else
skipped; so are FIFOs, sockets and devices. Each skip is reported as "path: why".
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
from pathlib import Path
from typing import Any


def plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def link_stays_inside(rel: str, target: str) -> bool:
    """A link at `rel` (relative to the tree's top) pointing at `target` stays in the tree."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return resolved != ".." and not resolved.startswith("../") and not resolved.startswith("/")


def pull_walk(fs: Any, top: str, local: Path) -> tuple[int, tuple[str, ...]]:
    """Copy the tree at `top` on `fs` (an SFTP client, or LocalFiles) into `local`; (regular files
    copied, skipped entries)."""
    count, skipped = 0, []
    stack = [(top, local, "")]
    while stack:
        rdir, ldir, rel_dir = stack.pop()
        ldir.mkdir(parents=True, exist_ok=True)
        for entry in fs.listdir_attr(rdir):
            name = entry.filename
            if not plain_name(name):
                skipped.append(f"{rel_dir}{name!r}: not a plain file name")
                continue
            rpath, lpath, rel = posixpath.join(rdir, name), ldir / name, rel_dir + name
            mode = entry.st_mode or 0
            if stat.S_ISLNK(mode):
                target = fs.readlink(rpath)
                if not link_stays_inside(rel, target):
                    skipped.append(f"{rel}: a link leading out of the run ({target})")
                    continue
                if lpath.is_symlink() or lpath.exists():
                    if lpath.is_dir() and not lpath.is_symlink():
                        shutil.rmtree(lpath)
                    else:
                        lpath.unlink()
                lpath.symlink_to(target)
            elif stat.S_ISDIR(mode):
                if lpath.is_symlink():  # left by an earlier pull: write into a real directory
                    lpath.unlink()
                stack.append((rpath, lpath, rel + "/"))
            elif stat.S_ISREG(mode):
                if lpath.is_symlink():
                    lpath.unlink()
                fs.get(rpath, str(lpath))
                count += 1
            else:
                skipped.append(f"{rel}: not a regular file")
    return count, tuple(skipped)


class LocalFiles:
    """This machine's files with the three calls pull_walk makes of an SFTP client."""

    class _Entry:
        def __init__(self, filename: str, st_mode: int):
            self.filename, self.st_mode = filename, st_mode

    def listdir_attr(self, path: str) -> list[Any]:
        return [self._Entry(e.name, e.stat(follow_symlinks=False).st_mode) for e in os.scandir(path)]

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def get(self, path: str, local: str) -> None:
        shutil.copy2(path, local)
