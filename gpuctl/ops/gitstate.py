"""Whether the code a push sends is exactly a commit's (`CodeVersion.dirty`), read from the
repository's object store with dulwich: no git process runs and no repository config is read, so a
cloned project's .git/config (core.fsmonitor, filters) makes nothing run here.

"Dirty" means what a reader of `status` needs: the run's code is not that commit. A file git
tracks below the project that the push sends with other content, a tracked file that is gone, or a
file the push sends that the commit does not hold. A tracked file the push leaves out (an ignore
rule) is not a difference: the run never had it. Line-ending and filter settings are not applied:
a checkout that relies on them (autocrlf, LFS) reads as dirty, never as clean when it is not.
"""

from __future__ import annotations

import stat
from pathlib import Path

MAX_ENTRIES = 200_000  # a tree bigger than this below the project: not told (None)
GITLINK = 0o160000  # a submodule's entry: its files are another repository's


def differs(project: Path, root: Path | None, common: Path | None, commit: str, blobs: dict[str, str]) -> bool | None:
    """True when `blobs` (each pushed file's blob id by its path below `project`) is not the
    commit's tree below `project`; None when that cannot be told (no object store, a missing or
    odd object, a tree past MAX_ENTRIES)."""
    if root is None or common is None or not (common / "objects").is_dir():
        return None
    try:
        tracked = _tree_below(common / "objects", commit, project.resolve().relative_to(root.resolve()))
    except Exception:  # dulwich's own errors, a corrupt pack, a commit not in the store: not told
        return None
    if tracked is None:
        return None
    for rel, blob in tracked.items():
        if rel in blobs:
            if blobs[rel] != blob:
                return True
        elif not (project / rel).exists() and not (project / rel).is_symlink():
            return True  # deleted
    return any(rel not in tracked for rel in blobs)


def _tree_below(objects: Path, commit: str, below: Path) -> dict[str, str] | None:
    from dulwich.object_store import DiskObjectStore, iter_tree_contents, tree_lookup_path
    from dulwich.objects import Commit, ObjectID

    store = DiskObjectStore(str(objects))
    head = store[ObjectID(commit.encode("ascii"))]
    if not isinstance(head, Commit):
        return None
    tree = head.tree
    if below.parts:
        mode, tree = tree_lookup_path(store.__getitem__, tree, below.as_posix().encode())
        if not stat.S_ISDIR(mode):
            return None
    found: dict[str, str] = {}
    for entry in iter_tree_contents(store, tree):
        if entry.mode == GITLINK or entry.path is None or entry.sha is None:
            continue
        if len(found) >= MAX_ENTRIES:
            return None
        found[entry.path.decode("utf-8", "surrogateescape")] = entry.sha.decode("ascii")
    return found
