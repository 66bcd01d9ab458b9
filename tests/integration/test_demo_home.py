"""`./scripts/demo` never touches a cluster it did not make. It runs in a gpuctl
home of its own (.demo-home/ in the repository) unless GPUCTL_HOME is set, and a live `demo`
cluster there that it did not make is refused before anything starts (no training: these tests
need no TensorFlow; tests/e2e/test_readme.py runs the whole demo).

Bad inputs tried: GPUCTL_HOME pointing at a home whose own `demo` cluster runs a job; a
`.demo-home` holding a `demo` cluster the demo did not make, with GPUCTL_HOME unset."""

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # the demo script, end to end: full tier (CONTRIBUTING.md, the tiers)

SLEEPER = "import time\nprint('working', flush=True)\ntime.sleep(600)\n"


def demo(env: dict, repo=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(repo / "scripts" / "demo")], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)


def users_demo_cluster(gpuctl, proj) -> str:
    """A `demo` cluster of the user's (in the GPUCTL_HOME set now), with a job running on it: the run's id."""
    gpuctl("up", "--name", "demo")
    return json.loads(gpuctl("train", proj, "--cluster", "demo", "--json").stdout)["run"]["run_id"]


def still_running(gpuctl, run_id: str) -> None:
    status = json.loads(gpuctl("status", "--json").stdout)
    assert [c["state"] for c in status["clusters"] if c["name"] == "demo"] == ["up"]
    assert [r["state"] for r in status["runs"] if r["run_id"] == run_id] == ["running"]
    assert len(status["runs"]) == 1  # the demo trained nothing here


def test_demo_refuses_a_demo_cluster_it_did_not_make_in_the_home_it_was_given(gpuctl, make_project, isolated):
    run_id = users_demo_cluster(gpuctl, make_project("mine", {"train.py": SLEEPER}))
    res = demo(dict(os.environ, GPUCTL_HOME=str(isolated)))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"Error: a cluster named 'demo' is up in {isolated} and the demo did not make it" in res.stderr
    assert "Hint:" in res.stderr and "gpuctl up" not in res.stderr
    still_running(gpuctl, run_id)


def test_demo_uses_its_own_home_unless_told_and_leaves_the_users_alone(gpuctl, make_project, isolated, tmp_path,
                                                                        monkeypatch):
    """With GPUCTL_HOME unset the demo works in REPO/.demo-home, never in the user's home. A copy
    of the repository's scripts (its .venv linked) keeps the real repository's .demo-home out of it."""
    proj = make_project("mine", {"train.py": SLEEPER})
    run_id = users_demo_cluster(gpuctl, proj)  # in the user's own home
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("demo", "need-packages"):
        shutil.copy2(REPO / "scripts" / name, repo / "scripts" / name)
    # Not the real bootstrap: with pyproject.toml newer than the venv's stamp (edited since the last
    # bootstrap) it reinstalled gpuctl into the linked .venv from this copy, which has no gpuctl,
    # and every later test (and the developer's venv) lost the package.
    (repo / "scripts" / "bootstrap").write_text("#!/bin/sh\nexit 0\n")
    (repo / "scripts" / "bootstrap").chmod(0o755)
    for name in (".venv", "pyproject.toml"):
        (repo / name).symlink_to(REPO / name)
    # A `demo` cluster in .demo-home that this demo did not make (no record of it): refused too.
    monkeypatch.setenv("GPUCTL_HOME", str(repo / ".demo-home"))
    users_demo_cluster(gpuctl, proj)
    env = {k: v for k, v in os.environ.items() if k != "GPUCTL_HOME"}
    res = demo(env, repo)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"demo: gpuctl home {repo / '.demo-home'}" in res.stderr
    assert f"a cluster named 'demo' is up in {repo / '.demo-home'}" in res.stderr
    monkeypatch.setenv("GPUCTL_HOME", str(isolated))
    still_running(gpuctl, run_id)
    monkeypatch.setenv("GPUCTL_HOME", str(repo / ".demo-home"))
    gpuctl("down", "demo", "-y")

