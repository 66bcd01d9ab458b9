"""Which files of a project a push sends: git's ignore rules, as git applies them.

`.gitignore` files at every level (deeper ones win, each relative to its own directory), then a
top-level `.gpuctlignore` that can add patterns or `!`-re-include, over DEFAULT_IGNORES. As in git,
an ignored directory is not walked, so nothing below it can be re-included without re-including
the directory itself. pathspec compiles each line (gitignore syntax); each pattern is then asked
about one path the way git asks while it walks, because pathspec's own match of a directory
pattern also covers everything below it (`*`, `!*/`, `!*.py` would keep every file).
"""

from __future__ import annotations

import os
import posixpath
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
import functools
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pathspec is imported when a rule is compiled: a report (status, cost) never needs it
    from pathspec import Pattern

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


class Rule(NamedTuple):
    """The ignore line that decided a path: its file (relative to the project; "" for gpuctl's
    defaults), its line number, its text."""

    source: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.source} line {self.line} `{self.text}`" if self.source else f"gpuctl's default `{self.text}`"


def _compile(lines: Iterable[str], source: str = "") -> _Spec | None:
    """None when no line is a pattern. Each line is compiled alone, so one that pathspec rejects
    (a lone `!`, a lone trailing backslash, a range like `[z-a]`: git matches nothing with those
    either) is dropped instead of failing the push."""
    from pathspec import GitIgnoreSpec

    kept: list[tuple[Rule, Pattern]] = []
    with warnings.catch_warnings():  # re's FutureWarning about `[[` in a glob is noise to a user
        warnings.simplefilter("ignore", FutureWarning)
        for number, line in enumerate(lines, 1):
            try:
                patterns = GitIgnoreSpec.from_lines([line]).patterns
            except (ValueError, re.error):  # pathspec's own errors are ValueErrors; re's come from a bad [range]
                continue
            rule = Rule(source, number, line.rstrip(" "))
            kept += [(rule, p) for p in patterns if p.include is not None]  # not blank or a comment
    return _Spec(kept) if kept else None


@functools.cache
def _dir_globstar_names_itself() -> bool:
    """pathspec (1.1) reads `x/**/` as `x/`, naming x itself; git names only the directories below x."""
    from pathspec import GitIgnoreSpec

    return GitIgnoreSpec.from_lines(["x/**/"]).patterns[0].match_file("x/") is not None


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

    def __init__(self, patterns: list[tuple[Rule, Pattern]]):
        self._rules = []  # last line first
        for rule, pattern in reversed(patterns):
            glob = rule.text.removeprefix("!")  # git drops unescaped trailing spaces
            core = glob.rstrip("/")
            core = core[3:] if core.startswith("**/") and "/" not in core[3:] else core
            anchored = "/" in core
            below = glob.endswith("/**/") and _dir_globstar_names_itself()
            self._rules.append((rule, pattern, glob.endswith("/"), anchored, anchored and not core.endswith("/**"),
                                below))

    def check(self, path: str, is_dir: bool) -> tuple[bool, Rule] | None:
        """(True: ignored, False: re-included (`!`); the line that says so), None: no pattern here names `path`."""
        parent, _, name = path.rpartition("/")
        for rule, pattern, dir_only, anchored, fixed_depth, below in self._rules:
            if dir_only and not is_dir:
                continue
            end = "/" if dir_only else ""
            if pattern.match_file((path if anchored else name) + end) is None:
                continue
            if fixed_depth and parent and pattern.match_file(parent + end) is not None:
                continue  # it names a directory above `path`, not `path`
            if below and not (parent and pattern.match_file(parent + end) is not None):
                continue  # `x/**/` names the directories below x, not x
            return bool(pattern.include), rule
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
        self._over = _compile(overrides, GPUCTLIGNORE)
        self._root = root
        # Every path `ignored` left out, with the line that did (push notes what a run may miss).
        self.left_out: list[tuple[str, bool, Rule]] = []
        # directory (relative, "" = top) -> its .gitignore layers, deepest first, as (prefix length, spec)
        self._chains: dict[str, tuple[tuple[int, _Spec], ...]] = {}

    @classmethod
    def for_project(cls, src: Path) -> IgnoreRules:
        return cls(DEFAULT_IGNORES, root=src, overrides=_read_patterns(src / GPUCTLIGNORE))

    def _chain(self, d: str) -> tuple[tuple[int, _Spec], ...]:
        chain = self._chains.get(d)
        if chain is None:
            chain = self._chain(d.rpartition("/")[0]) if d else ()
            own = (_compile(_read_patterns(self._root / d / GITIGNORE), posixpath.join(d, GITIGNORE))
                   if self._root is not None else None)
            if own is not None:
                chain = ((len(d) + 1 if d else 0, own),) + chain
            self._chains[d] = chain
        return chain

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """`rel`: POSIX path relative to the project. Callers walk top-down and never ask about
        what lies below an ignored directory: git cannot re-include a file there either."""
        hit = self.rule(rel, is_dir)
        if hit is not None and hit[0]:
            self.left_out.append((rel, is_dir, hit[1]))
            return True
        return False

    def rule(self, rel: str, is_dir: bool) -> tuple[bool, Rule] | None:
        """(whether `rel` is ignored, the line that decides it); None where no line names it."""
        if self._over is not None and (hit := self._over.check(rel, is_dir)) is not None:
            return hit
        for cut, spec in self._chain(rel.rpartition("/")[0]):
            if (hit := spec.check(rel[cut:], is_dir)) is not None:
                return hit
        return self._base.check(rel, is_dir) if self._base is not None else None


# --- what a push leaves out, said ------------------------------------------------------------------

SAY_OVER = 5_000_000  # bytes left out in all by the project's own rules past which a push says so
SIZE_BUDGET = 20_000  # entries a note stats at most (an ignored node_modules must not slow every push)
SAY_AT_MOST = 3  # entries a note names


def _size(path: str, budget: list[int]) -> int:
    """Bytes under `path` (links not followed), stopping when `budget[0]` entries have been looked at."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    budget[0] -= 1
    if not os.path.isdir(path) or os.path.islink(path):
        return st.st_size
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if budget[0] <= 0:
                    break
                total += _size(entry.path, budget)
    except OSError:
        pass
    return total


def _sized(src: Path, items: Iterable[tuple[str, bool, Rule]]) -> tuple[list[tuple[str, int, Rule]], bool]:
    """(name as said ("dir/" for a directory), bytes, rule) for each item, largest first; and whether
    the budget ran out (the sizes are then at least those)."""
    budget = [SIZE_BUDGET]
    out = [(rel + "/" if is_dir else rel, _size(os.path.join(src, rel), budget), rule) for rel, is_dir, rule in items]
    return sorted(out, key=lambda x: -x[1]), budget[0] <= 0


def _re_include(name: str, rule: Rule) -> str:
    """What undoes `rule` for `name`: the line's own `!` form where it is top-level, else the path."""
    if rule.source == GPUCTLIGNORE:
        return f"remove line {rule.line} `{rule.text}` from {GPUCTLIGNORE}"
    line = "!" + (rule.text if "/" not in rule.source else "/" + re.sub(r"([\\*?\[])", r"\\\1", name))
    return f"add `{line}` to {GPUCTLIGNORE}"


def _note(sized: list[tuple[str, int, Rule]], partial: bool, hint: str) -> str:
    """One line: the entries left out, largest first, each with its rule; how to push the largest."""
    at_least = "at least " if partial else ""
    from gpuctl.remote.sync import size_text  # the push's own units

    name, nbytes, rule = sized[0]
    if len(sized) == 1:
        return f"left out {name} ({at_least}{size_text(nbytes)}) by {rule}: {hint}{_re_include(name, rule)}"
    named = ", ".join(f"{n} ({size_text(b)}, {r})" for n, b, r in sized[:SAY_AT_MOST])
    more = f" and {len(sized) - SAY_AT_MOST} more" if len(sized) > SAY_AT_MOST else ""
    total = size_text(sum(b for _, b, _ in sized))
    return f"left out {at_least}{total}: {named}{more}; to push {name}: {hint}{_re_include(name, rule)}"


def left_out_note(src: Path, rules: IgnoreRules) -> str | None:
    """After a scan with `rules`: one line on what the project's own rules (not gpuctl's defaults)
    left out, when that is over SAY_OVER in all; None otherwise."""
    own = [item for item in rules.left_out if item[2].source]
    if not own:
        return None
    sized, partial = _sized(src, own)
    return _note(sized, partial, "") if sum(b for _, b, _ in sized) >= SAY_OVER else None


def named_left_out(src: Path, rels: Iterable[str], data: bool = False) -> list[str]:
    """A line for each of `rels` (paths relative to `src`) that the push leaves out, itself or a
    directory above it, asked top-down as the scan asks; `data`: `src` is a --data directory."""
    rules = IgnoreRules.for_project(src)
    said: dict[str, str] = {}
    for rel in rels:
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            is_dir = (src / sub).is_dir()
            hit = rules.rule(sub, is_dir)
            if hit is not None and hit[0]:
                if sub not in said:
                    hint = "" if data else "pass it with --data, or "
                    said[sub] = _note(*_sized(src, [(sub, is_dir, hit[1])]), hint)
                break
    return list(said.values())


def named_by(project: Path, args: Iterable[str]) -> list[str]:
    """The project paths (relative, existing) a script's arguments name: each argument, or what
    follows `=` in one, read as a path from the project (the job's working directory)."""
    out = []
    for arg in args:
        for text in (arg, arg.partition("=")[2]):
            if not text or "\0" in text:
                continue
            path = Path(os.path.normpath(project / text))
            if path != project and path.is_relative_to(project) and os.path.lexists(path):
                out.append(path.relative_to(project).as_posix())
    return out
