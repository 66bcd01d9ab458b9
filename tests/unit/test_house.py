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
    """The contracts bite: a copy of the package where remote/ reaches up into ops/ (lazily), a
    payload imports gpuctl, and two modules of ops/ import each other (one lazily, as cycles used
    to be held apart) fails, naming each import."""
    shutil.copytree(REPO / "gpuctl", tmp_path / "gpuctl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "gpuctl" / "remote" / "jobs.py", "a") as fh:
        fh.write("\n\ndef _upward():\n    from gpuctl.ops import session\n\n    return session\n")
    with open(tmp_path / "gpuctl" / "payloads" / "gpuctl_report.py", "a") as fh:
        fh.write("\n\ndef _gpuctl():\n    import gpuctl.errors\n\n    return gpuctl.errors\n")
    with open(tmp_path / "gpuctl" / "ops" / "push.py", "a") as fh:  # ops/runs.py imports push
        fh.write("\n\ndef _cycle():\n    from gpuctl.ops import runs\n\n    return runs\n")
    res = run([tool("lint-imports"), "--no-cache"], tmp_path, PYTHONPATH=str(tmp_path))
    assert res.returncode != 0
    assert "gpuctl.remote.jobs -> gpuctl.ops.session" in res.stdout, res.stdout[-4000:]
    assert "gpuctl.payloads.gpuctl_report -> gpuctl.errors" in res.stdout, res.stdout[-4000:]
    assert "no import cycles" in res.stdout and "BROKEN" in res.stdout.split("no import cycles")[1][:200], res.stdout[-4000:]
    assert "No cycles are allowed in gpuctl.ops" in res.stdout and "- .push -> .runs" in res.stdout, res.stdout[-4000:]


def test_every_host_has_the_whole_host_contract():
    """Callers hold a `Host` (remote/host.py) and use nothing else of it; the push over SSH holds an
    `SshShell`. Both hosts have every member their contract declares, so a caller typed by the
    contract never meets an AttributeError on one kind of host only."""
    from gpuctl.remote.host import Host, SshShell
    from gpuctl.remote.local import LocalHost
    from gpuctl.remote.ssh.host import SshHost

    def members(proto: type) -> set[str]:
        names = set()
        for cls in proto.__mro__:
            if cls in (object,) or cls.__name__ in ("Protocol", "Generic"):
                continue
            names |= set(getattr(cls, "__annotations__", {}))
            names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
        return names

    host_members = members(Host)
    assert {"run", "read_bytes", "push", "deadline", "timed_out", "root", "label", "command_timeout_s"} <= host_members
    local = LocalHost(REPO)
    for name in sorted(host_members):
        assert hasattr(local, name), f"LocalHost lacks {name}"
    for name in sorted(members(SshShell)):  # SshHost's instance attributes are set in __init__
        assert hasattr(SshHost, name) or name in SshHost.__init__.__code__.co_names, f"SshHost lacks {name}"
