"""Incremental project push: what to send, what to skip, what to delete.

A push compares the project's files (size, mtime) with the manifest of the previous push kept in
the destination, so an unchanged project copies nothing and a one-file change copies that file.
Only files gpuctl itself pushed before are ever deleted: outputs a job wrote next to the code
(checkpoints, logs) survive the next push.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from gpuctl.types import SyncStats

MANIFEST = ".gpuctl-manifest.json"
IGNORE_FILES = (".gitignore", ".gpuctlignore")
# Never worth shipping to a GPU box; a project's own ignore files can re-include with `!`.
DEFAULT_IGNORES = (".git/", "__pycache__/", "*.pyc", ".venv/", ".ipynb_checkpoints/", MANIFEST)


def _glob_to_regex(glob: str) -> str:
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : end].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


class IgnoreRules:
    """A working subset of gitignore: globs, `**`, `!` negation, trailing `/`, leading `/`.

    Only the project's top-level ignore files are read (nested .gitignore files are not).
    """

    def __init__(self, patterns: list[str]):
        self.rules: list[_Rule] = []
        for raw in patterns:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:]
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            line = line.lstrip("/")
            prefix = "^" if anchored else "^(?:.*/)?"
            self.rules.append(_Rule(re.compile(prefix + _glob_to_regex(line) + "$"), negate, dir_only))

    @classmethod
    def for_project(cls, src: Path) -> "IgnoreRules":
        patterns = list(DEFAULT_IGNORES)
        for name in IGNORE_FILES:
            path = src / name
            if path.is_file():
                patterns += path.read_text(encoding="utf-8", errors="replace").splitlines()
        return cls(patterns)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        result = False
        for rule in self.rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(rel):
                result = not rule.negate
        return result


def scan(src: Path, rules: IgnoreRules) -> dict[str, tuple[int, int]]:
    """Relative POSIX path -> (size, mtime_ns) of every file to push; ignored dirs are pruned."""
    files: dict[str, tuple[int, int]] = {}
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
    return files


def push_local(src: Path, dest: Path) -> SyncStats:
    """Mirror `src` into `dest` on this filesystem, copying only what changed since the last push."""
    t0 = time.perf_counter()
    rules = IgnoreRules.for_project(src)
    current = scan(src, rules)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST
    try:
        previous = {k: tuple(v) for k, v in json.loads(manifest_path.read_text()).items()}
    except (OSError, ValueError):
        previous = {}

    copied = nbytes = 0
    for rel, sig in current.items():
        target = dest / rel
        if previous.get(rel) == sig and target.is_file() and target.stat().st_size == sig[0]:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.gpuctl-tmp")
        shutil.copy2(src / rel, tmp)
        os.replace(tmp, target)  # atomic: a job reading the file never sees half of it
        copied += 1
        nbytes += sig[0]

    deleted = 0
    for rel in previous.keys() - current.keys():
        try:
            (dest / rel).unlink()
            deleted += 1
        except FileNotFoundError:
            pass

    tmp_manifest = manifest_path.with_suffix(".tmp")
    tmp_manifest.write_text(json.dumps({k: list(v) for k, v in current.items()}))
    os.replace(tmp_manifest, manifest_path)
    return SyncStats(
        files_total=len(current),
        files_copied=copied,
        bytes_copied=nbytes,
        files_deleted=deleted,
        seconds=time.perf_counter() - t0,
    )
