"""Which code a run ran (`status RUN`, `cost RUN`): a short hash of the files pushed, computed
here from the project as the push sees it, and, when the project is in a git checkout, its commit.

A project is data: git is never run in it (a cloned repository's .git/config can make git run
commands: core.fsmonitor, filters). HEAD and the refs are read here as files, each with a bound,
a FIFO or an odd path giving no commit rather than a hang or a read outside the repository.
Whether the code pushed differs from that commit (`dirty`) is read the same way, with dulwich
(git's object store, loose and packed, in Python: no git process, no config, no filter run): the
commit's tree below the project compared with the files the push sends, by their blob ids.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from gpuctl.errors import GpuctlError
from gpuctl.model.records import CodeVersion
from gpuctl.ops import gitstate
from gpuctl.remote.local import read_local
from gpuctl.remote.sync import scan
from gpuctl.remote.sync.ignore import IgnoreRules

HASH_HEX = 12
GIT_FILE_MAX = 4096  # HEAD, a loose ref, a .git file, commondir: one short line each
PACKED_REFS_MAX = 16 << 20  # a repository with ~200,000 tags
MAX_SYMREF_HOPS = 5
MAX_PARENTS = 64  # how far up a checkout's root is looked for
OBJECT_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # SHA-1, or SHA-256


def of(project: Path) -> CodeVersion:
    """The project's code version as a push sends it."""
    digest, blobs = _hashes(project)
    commit = dirty = None
    try:
        commit = git_commit(project)
        if commit is not None:
            dirty = gitstate.differs(project, _checkout_root(project), _common(git_dir(project)), commit, blobs)
    except (OSError, GpuctlError):  # an unreadable .git: no commit, the run goes on
        pass
    return CodeVersion(hash=digest, commit=commit, dirty=dirty)


def tree_hash(project: Path) -> str:
    """sha256 over each pushed file's path and content, in path order: 12 hex."""
    return _hashes(project)[0]


def _hashes(project: Path) -> tuple[str, dict[str, str]]:
    """tree_hash, and each pushed file's git blob id (hex) by its relative path, from one read."""
    h = hashlib.sha256()
    blobs: dict[str, str] = {}
    for rel in sorted(scan(project, IgnoreRules.for_project(project))):
        content = hashlib.sha256()
        path = project / rel
        blob = hashlib.sha1(b"blob %d\0" % path.stat().st_size, usedforsecurity=False)
        with open(path, "rb") as fh:  # a link the scan kept: its content, as pushed
            while chunk := fh.read(1 << 20):
                content.update(chunk)
                blob.update(chunk)
        if path.is_symlink():  # git holds a link as its target's name
            target = os.fsencode(os.readlink(path))
            blob = hashlib.sha1(b"blob %d\0" % len(target) + target, usedforsecurity=False)
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0" + content.digest())
        blobs[rel] = blob.hexdigest()
    return h.hexdigest()[:HASH_HEX], blobs


def _line(path: Path, limit: int = GIT_FILE_MAX) -> str | None:
    data = read_local(str(path), 0, limit)
    return data.decode("utf-8", "replace").strip() if data else None


def _checkout_root(project: Path) -> Path | None:
    for d in (project, *list(project.parents)[:MAX_PARENTS]):
        if (d / ".git").exists():
            return d
    return None


def git_dir(project: Path) -> Path | None:
    """The .git directory of the checkout the project is in (itself or a directory above)."""
    d = _checkout_root(project)
    if d is not None:
        dot = d / ".git"
        if dot.is_dir():
            return dot
        if dot.is_file():  # a worktree or a submodule: "gitdir: PATH"
            text = _line(dot)
            if not text or not text.startswith("gitdir:"):
                return None
            found = Path(text[len("gitdir:"):].strip())
            found = found if found.is_absolute() else d / found
            return found if found.is_dir() else None
    return None


def _plain_ref(ref: str) -> bool:
    parts = ref.split("/")
    return ref.startswith("refs/") and "\\" not in ref and "\0" not in ref and \
        all(p not in ("", ".", "..") for p in parts)


def _packed(common: Path, ref: str) -> str | None:
    data = read_local(str(common / "packed-refs"), 0, PACKED_REFS_MAX)
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        sha, _, name = line.partition(" ")
        if name == ref and OBJECT_ID.fullmatch(sha):
            return sha
    return None


def _common(gitdir: Path | None) -> Path | None:
    """Where the refs and objects are: a worktree's live in the main repository's."""
    if gitdir is None:
        return None
    common_rel = _line(gitdir / "commondir")
    return (gitdir / common_rel) if common_rel else gitdir


def git_commit(project: Path) -> str | None:
    """HEAD's commit (hex), read as files; None when the project is in no checkout, or HEAD
    leads nowhere readable (an unborn branch, a ref gpuctl does not follow)."""
    gitdir = git_dir(project)
    if gitdir is None:
        return None
    common = _common(gitdir) or gitdir
    text = _line(gitdir / "HEAD")
    for _ in range(MAX_SYMREF_HOPS):
        if text is None:
            return None
        if OBJECT_ID.fullmatch(text):
            return text
        ref = text[len("ref:"):].strip() if text.startswith("ref:") else ""
        if not _plain_ref(ref):
            return None
        text = _line(gitdir / ref) or _line(common / ref) or _packed(common, ref)
    return None
