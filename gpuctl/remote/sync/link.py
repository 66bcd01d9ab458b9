"""A run's own copy of a pushed tree (its code, its data): every file a hard link to the pushed
one, so a copy costs directory entries, not bytes, and files unchanged between runs are shared.

This is safe because no push ever writes into a pushed file: each one replaces a changed file with
a new one under a temporary name, renamed into place (push_local, rsync's default, the tar
unpacker), so a later push gives the pushed tree a new inode and the runs' links keep the old.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from gpuctl.files import unique_suffix

# The remote side of Host.link_tree: GNU (and BusyBox) cp makes the links; -f replaces a file
# already in the run's copy (a resume links the code pushed since over the run's own).
LINK_SCRIPT = 'mkdir -p -- "$2" && cp -alf -- "$1/." "$2/"'


def link_argv(src: str, dest: str) -> list[str]:
    """The one command that links `src`'s files into `dest` on a host (each path a quoted argument)."""
    return ["sh", "-c", LINK_SCRIPT, "sh", src, dest]


def link_local(src: Path, dest: Path) -> int:
    """Every regular file below `src` linked into `dest` under the same relative path (a file of
    that name there is replaced; anything else there stays); how many. Where a link cannot be
    made (another filesystem), the file is copied."""
    n = 0
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        folder = dest if rel == "." else dest / rel
        folder.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            source = os.path.join(dirpath, name)
            if not stat.S_ISREG(os.lstat(source).st_mode):
                continue  # a push writes regular files only
            tmp = folder / f".{name}.{unique_suffix()}.gpuctl-tmp"
            try:
                os.link(source, tmp, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copy2(source, tmp)
            os.replace(tmp, folder / name)
            n += 1
    return n
