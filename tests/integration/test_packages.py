"""A project's requirements.txt installed for its runs (ops/packages.py, payloads/gpuctl_packages.py):
a real pip installs a small pure-Python wheel from a local wheelhouse (these hosts have no network:
never PyPI) into a venv layered on the run's Python, on the local provider and on an sshd host;
the same file again installs nothing; a project without it does not see the package.

Bad inputs tried: a line pinning another TensorFlow (refused in one line naming it, nothing made),
a package the wheelhouse lacks (pip's last line, with the log's path), `train.requirements`
outside the project and naming no file."""

from __future__ import annotations

import json
import subprocess
from typing import Callable

import pytest

from tests.integration.test_ssh import up_ssh
from tests.small_wheels import wheel
from tests.sshd import WORKDIR

pytestmark = pytest.mark.slow  # real pip and venvs: full tier (CONTRIBUTING.md, the tiers)

USES = '''
import sys
try:
    import tinydep
    print("tinydep says", tinydep.WORD, "from", sys.executable, flush=True)
except ImportError:
    print("no tinydep here", flush=True)
'''


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    where = tmp_path / "wheelhouse"
    where.mkdir()
    wheel(where, "tinydep", "1.0", {"tinydep/__init__.py": 'WORD = "hello"\n'})
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(where))
    return where


def loop(gpuctl, make_project, envs: str, sh: Callable[[str], str]) -> None:
    """Install, reuse, a project without the file, a pin of another TensorFlow: on the cluster up
    now, whose layered venvs are in `envs` on the host `sh` runs a shell command on."""
    def envs_of() -> list[str]:
        return sh(f"cd {envs} && for d in req-*; do [ -d $d ] && echo {envs}/$d; done").split()

    proj = make_project("with", {"train.py": USES, "requirements.txt": "tinydep==1.0  # the one we need\n"})
    first = gpuctl("train", proj, "--allow-cpu", "--wait")
    assert "tinydep says hello" in first.stdout, first.stdout + first.stderr
    assert "installing 1 requirement(s) of requirements.txt" in first.stderr
    assert "ready: the project's packages in" in first.stderr
    (env,) = envs_of()
    assert f"from {env}/bin/python" in first.stdout  # the job ran with the layered venv's Python
    made = sh(f"stat -c %Y.%y {env}/.gpuctl-ready")
    status = gpuctl("status").stdout
    assert "packages: requirements.txt (sha256 " in status and "installed in" in status

    again = gpuctl("train", proj, "--allow-cpu", "--wait")
    assert "tinydep says hello" in again.stdout
    assert "installing" not in again.stderr and f"requirements.txt ready in {env}" in again.stderr
    assert sh(f"stat -c %Y.%y {env}/.gpuctl-ready") == made and envs_of() == [env]
    runs = json.loads(gpuctl("status", "--json").stdout)["runs"]
    assert sorted(r["packages_s"] > 0 for r in runs) == [False, True]  # installed once, then made already

    plain = make_project("without", {"train.py": USES})
    assert "no tinydep here" in gpuctl("train", plain, "--allow-cpu", "--wait").stdout

    pinned = make_project("pinned", {"train.py": USES, "requirements.txt": "tinydep\ntensorflow==2.15.0\n"})
    refused = gpuctl("train", pinned, "--allow-cpu", code=6)
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("Error:")]
    assert "requirements.txt line 2 (tensorflow==2.15.0) asks for another TensorFlow than the cluster's" in line
    assert envs_of() == [env]  # nothing made for it


def test_requirements_on_the_local_provider(gpuctl, make_project, wheelhouse, isolated):
    gpuctl("up", "-y")
    loop(gpuctl, make_project, str(isolated / "clusters" / "_envs"),
         lambda cmd: subprocess.run(["sh", "-c", cmd], capture_output=True, text=True).stdout)


@pytest.mark.sshd
def test_requirements_on_an_sshd_host(gpuctl, ssh, make_project, wheelhouse):
    up_ssh(gpuctl, ssh)
    loop(gpuctl, make_project, f"{WORKDIR}/_envs", lambda cmd: ssh.hosts[0].run(cmd).stdout)
    gpuctl("down", "-y")


def test_a_package_pip_cannot_find_says_pips_last_line(gpuctl, make_project, wheelhouse, isolated, monkeypatch):
    gpuctl("up", "-y")
    proj = make_project("missing", {"train.py": USES, "requirements.txt": "tinydep\nnosuchdep==9\n"})
    res = gpuctl("train", proj, code=7)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert "installing requirements.txt failed on" in line and "No matching distribution found for nosuchdep==9" in line
    assert "pip's whole output is in" in res.stderr
    envs = isolated / "clusters" / "_envs"
    assert not [p for p in envs.glob("req-*") if p.is_dir()]  # the half-made venv is gone, no run was started
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []

    # train.requirements: another name inside the project, never a path out of it.
    (proj / "deps").mkdir()
    (proj / "deps" / "run.txt").write_text("tinydep\n")
    (proj / "gpuctl.toml").write_text('[train]\nrequirements = "deps/run.txt"\n')
    assert "tinydep says hello" in gpuctl("train", proj, "--wait").stdout
    (proj / "gpuctl.toml").write_text('[train]\nrequirements = "../../elsewhere.txt"\n')
    out = gpuctl("train", proj, code=3).stderr
    assert "train.requirements = '../../elsewhere.txt' is outside the project" in out and "pushed" not in out
