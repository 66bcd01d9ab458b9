"""The house rules tools check, in both tiers: ruff's small rule set and
import-linter's contracts (both in pyproject.toml), so an upward import across the layers of
docs/architecture.md, a payload importing gpuctl, or a pyflakes error fails the tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}: run scripts/bootstrap (pyproject.toml's dev extra names it)")
    return str(path)


def run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_ruff_finds_nothing():
    res = run([tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."], REPO)
    assert res.returncode == 0, res.stdout + res.stderr


def test_imports_keep_the_layers():
    res = run([tool("lint-imports"), "--no-cache"], REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr


def test_a_new_upward_import_breaks_the_layers(tmp_path):
    """The contract bites: a copy of the package where remote/ reaches up into ops/ (lazily, as
    today's listed exceptions do) and a payload imports gpuctl fails, naming both imports."""
    shutil.copytree(REPO / "gpuctl", tmp_path / "gpuctl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "gpuctl" / "remote" / "jobs.py", "a") as fh:
        fh.write("\n\ndef _upward():\n    from gpuctl.ops import session\n\n    return session\n")
    with open(tmp_path / "gpuctl" / "payloads" / "gpuctl_report.py", "a") as fh:
        fh.write("\n\ndef _gpuctl():\n    import gpuctl.errors\n\n    return gpuctl.errors\n")
    res = run([tool("lint-imports"), "--no-cache"], tmp_path, PYTHONPATH=str(tmp_path))
    assert res.returncode != 0
    assert "gpuctl.remote.jobs -> gpuctl.ops.session" in res.stdout, res.stdout[-4000:]
    assert "gpuctl.payloads.gpuctl_report -> gpuctl.errors" in res.stdout, res.stdout[-4000:]
