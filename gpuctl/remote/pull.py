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

from gpuctl.remote.sync import path_inside


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


def pull_walk(fs: Any, top: str, local: Path) -> tuple[int, tuple[str, ...]]:
    """Copy the tree at `top` on `fs` (an SFTP client, or LocalFiles) into `local`; (regular files
    copied, skipped entries). Links are made last, once every file and directory is in place, so
    no listing order can make a write go through one."""
    count, skipped, links = 0, [], []
    local.mkdir(parents=True, exist_ok=True)
    stack = [(top, local, "")]
    while stack:
        rdir, ldir, rel_dir = stack.pop()
        if ldir.is_symlink() or not _inside(ldir, local):
            skipped.append(f"{rel_dir or '.'}: a directory that is not one here")
            continue
        ldir.mkdir(exist_ok=True)
        seen: set[str] = set()
        for entry in fs.listdir_attr(rdir):
            name = entry.filename
            if not plain_name(name) or name in seen:
                skipped.append(f"{rel_dir}{name!r}: " + ("listed twice" if name in seen else "not a plain file name"))
                continue
            seen.add(name)
            rpath, lpath, rel = posixpath.join(rdir, name), ldir / name, rel_dir + name
            mode = entry.st_mode or 0
            if stat.S_ISLNK(mode):
                target = fs.readlink(rpath)
                if link_stays_inside(rel, target):
                    links.append((lpath, target))
                else:
                    skipped.append(f"{rel}: a link leading out of the run ({target})")
            elif stat.S_ISDIR(mode):
                if lpath.is_symlink() or (lpath.exists() and not lpath.is_dir()):
                    _clear(lpath)
                stack.append((rpath, lpath, rel + "/"))
            elif stat.S_ISREG(mode):
                if lpath.is_symlink() or lpath.is_dir():
                    _clear(lpath)
                fs.get(rpath, str(lpath))
                count += 1
            else:
                skipped.append(f"{rel}: not a regular file")
    for lpath, target in links:
        if _inside(lpath.parent, local):
            _clear(lpath)
            lpath.symlink_to(target)
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
