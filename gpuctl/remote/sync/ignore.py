"""Which files of a project a push sends: git's ignore rules, as git applies them.

`.gitignore` files at every level (deeper ones win, each relative to its own directory), then a
top-level `.gpuctlignore` that can add patterns or `!`-re-include, over DEFAULT_IGNORES. As in git,
an ignored directory is not walked, so nothing below it can be re-included without re-including
the directory itself. pathspec compiles each line (gitignore syntax); each pattern is then asked
about one path the way git asks while it walks, because pathspec's own match of a directory
pattern also covers everything below it (`*`, `!*/`, `!*.py` would keep every file).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path

from pathspec import GitIgnoreSpec, Pattern

MANIFEST = ".gpuctl-manifest"

GITIGNORE, GPUCTLIGNORE = ".gitignore", ".gpuctlignore"
# Never worth shipping to a GPU box; a project's own ignore files can re-include with `!`.
DEFAULT_IGNORES = (".git/", "__pycache__/", "*.pyc", ".venv/", ".ipynb_checkpoints/", MANIFEST)


def _read_patterns(path: Path) -> list[str]:
    """An ignore file's lines as git reads them: split on LF, one CR before it dropped, a UTF-8 BOM
    skipped. Undecodable bytes stay as surrogates, the way os.walk decodes such file names, so a
    Latin-1 pattern still matches the Latin-1 name. An unreadable file counts as empty."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    data = data.removeprefix(b"\xef\xbb\xbf")
    return [ln.removesuffix(b"\r").decode("utf-8", "surrogateescape") for ln in data.split(b"\n")]


def _compile(lines: Iterable[str]) -> _Spec | None:
    """None when no line is a pattern. Each line is compiled alone, so one that pathspec rejects
    (a lone `!`, a lone trailing backslash, a range like `[z-a]`: git matches nothing with those
    either) is dropped instead of failing the push."""
    kept: list[tuple[str, Pattern]] = []
    with warnings.catch_warnings():  # re's FutureWarning about `[[` in a glob is noise to a user
        warnings.simplefilter("ignore", FutureWarning)
        for line in lines:
            try:
                patterns = GitIgnoreSpec.from_lines([line]).patterns
            except (ValueError, re.error):  # pathspec's own errors are ValueErrors; re's come from a bad [range]
                continue
            kept += [(line, p) for p in patterns if p.include is not None]  # not blank or a comment
    return _Spec(kept) if kept else None


# pathspec (1.1) reads `x/**/` as `x/`, naming x itself; git names only the directories below x.
_DIR_GLOBSTAR_NAMES_ITSELF = GitIgnoreSpec.from_lines(["x/**/"]).patterns[0].match_file("x/") is not None


class _Spec:
    """One ignore file's patterns, each asked about one path the way git asks while walking.

    pathspec compiles the patterns (the glob translation), but a pathspec match also covers
    everything below a matched directory, while git decides each path alone once the walk has let
    its directory through (`*/` then `!sub/` brings back sub/, not the directories in it). So a
    pattern without a slash (bar a trailing one; `**/name` is `name`) is asked about the last
    name only; one with a slash about the path relative to the ignore file, and unless it ends in
    `/**` it does not count where it also names the parent. A `name/` pattern is asked about
    directories only, as "d/". The last pattern that names the path decides.
    """

    def __init__(self, patterns: list[tuple[str, Pattern]]):
        self._rules = []  # last line first
        for line, pattern in reversed(patterns):
            glob = line.rstrip(" ").removeprefix("!")  # git drops unescaped trailing spaces
            core = glob.rstrip("/")
            core = core[3:] if core.startswith("**/") and "/" not in core[3:] else core
            anchored = "/" in core
            below = _DIR_GLOBSTAR_NAMES_ITSELF and glob.endswith("/**/")
            self._rules.append((pattern, glob.endswith("/"), anchored, anchored and not core.endswith("/**"), below))

    def check(self, path: str, is_dir: bool) -> bool | None:
        """True: ignored, False: re-included (`!`), None: no pattern here names `path`."""
        parent, _, name = path.rpartition("/")
        for pattern, dir_only, anchored, fixed_depth, below in self._rules:
            if dir_only and not is_dir:
                continue
            end = "/" if dir_only else ""
            if pattern.match_file((path if anchored else name) + end) is None:
                continue
            if fixed_depth and parent and pattern.match_file(parent + end) is not None:
                continue  # it names a directory above `path`, not `path`
            if below and not (parent and pattern.match_file(parent + end) is not None):
                continue  # `x/**/` names the directories below x, not x
            return pattern.include
        return None


class IgnoreRules:
    """Which project paths a push skips, decided as git decides (last matching pattern wins):

    `patterns` (the defaults) lose to every .gitignore, a deeper .gitignore beats a shallower one
    for the paths below it (its patterns relative to its own directory), and `overrides`
    (.gpuctlignore) beat them all. With `root`, each directory's .gitignore is read once, the
    first time a path below it is asked about.
    """

    def __init__(self, patterns: Iterable[str] = (), root: Path | None = None, overrides: Iterable[str] = ()):
        self._base = _compile(patterns)
        self._over = _compile(overrides)
        self._root = root
        # directory (relative, "" = top) -> its .gitignore layers, deepest first, as (prefix length, spec)
        self._chains: dict[str, tuple[tuple[int, _Spec], ...]] = {}

    @classmethod
    def for_project(cls, src: Path) -> IgnoreRules:
        return cls(DEFAULT_IGNORES, root=src, overrides=_read_patterns(src / GPUCTLIGNORE))

    def _chain(self, d: str) -> tuple[tuple[int, _Spec], ...]:
        chain = self._chains.get(d)
        if chain is None:
            chain = self._chain(d.rpartition("/")[0]) if d else ()
            own = _compile(_read_patterns(self._root / d / GITIGNORE)) if self._root is not None else None
            if own is not None:
                chain = ((len(d) + 1 if d else 0, own),) + chain
            self._chains[d] = chain
        return chain

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """`rel`: POSIX path relative to the project. Callers walk top-down and never ask about
        what lies below an ignored directory: git cannot re-include a file there either."""
        if self._over is not None and (hit := self._over.check(rel, is_dir)) is not None:
            return hit
        for cut, spec in self._chain(rel.rpartition("/")[0]):
            if (hit := spec.check(rel[cut:], is_dir)) is not None:
                return hit
        return bool(self._base is not None and self._base.check(rel, is_dir))
