"""The type check, in both tiers (the proof that it bites, a cold mypy run of a mutated copy, in the full tier): scripts/typecheck runs mypy strict on gpuctl/ (and the fakes
the tests use, against the protocols they stand in for) as Python 3.10, then on the payloads as
the instance's Python 3.8 (config: pyproject.toml's [tool.mypy]). The cache (.mypy_cache) keeps a
warm run to a few seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def typecheck(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(root / "scripts" / "typecheck"), "--cache-dir", str(cache)], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PY": sys.executable})


def test_the_types_check():
    res = typecheck(REPO, REPO / ".mypy_cache")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert res.stdout.count("Success: no issues found") == 2, res.stdout


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_a_type_error_fails_the_check():
    """The check bites: a copy of the tree where an ops/ module returns a str for an int, a
    payload uses what Python 3.8 lacks (str.removeprefix, 3.9) and the fake host loses a method
    of the Host protocol fails, naming each. The copy is made in one place, files keeping their
    times, so that mypy's cache of it stays warm from one run to the next (cold: ~20 s)."""
    tree = REPO / ".mypy_cache" / "mutated-tree"
    shutil.rmtree(tree, ignore_errors=True)
    for part in ("gpuctl", "tests", "scripts"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tree / "pyproject.toml")
    with open(tree / "gpuctl" / "ops" / "costs.py", "a") as fh:
        fh.write("\n\ndef _broken() -> int:\n    return 'one'\n")
    with open(tree / "gpuctl" / "payloads" / "gpuctl_decide.py", "a") as fh:
        fh.write("\n\ndef _newer():\n    return 'gpuctl-x'.removeprefix('gpuctl-')\n")
    fakes = tree / "tests" / "fakes.py"
    fakes.write_text(fakes.read_text().replace("def pull_tree(", "def pull_files("))
    res = typecheck(tree, REPO / ".mypy_cache" / "mutated")
    assert res.returncode != 0
    assert 'gpuctl/ops/costs.py' in res.stdout and "Incompatible return value type (got \"str\", expected \"int\")" \
        in res.stdout, res.stdout[-4000:]
    assert 'gpuctl_decide.py' in res.stdout and '"str" has no attribute "removeprefix"' in res.stdout, res.stdout[-4000:]
    assert 'tests/fakes.py' in res.stdout and '"FakeHost", variable has type "Host"' in res.stdout, res.stdout[-4000:]
