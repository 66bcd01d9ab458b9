"""A push never carries the gpuctl home, the keys gpuctl made, or the user's ~/.ssh and ~/.aws,
whatever the project's ignore files say, also through links. Local provider (this machine plays
the instance), the real CLI; the homes are the test's temp dirs (conftest's `isolated`).

Bad inputs tried: a home inside the project re-included by `!` in .gpuctlignore; a link in the
project to ~/.ssh, and one to ~/.aws/credentials, where the project is HOME itself (so the links
stay inside it); a project that is the gpuctl home's own directory; `--data ~/.aws`."""

from __future__ import annotations

import json
import os

from gpuctl.remote.sync import IgnoreRules, scan
from tests.conftest import QUICK_TRAIN


def test_a_home_inside_the_project_is_never_pushed_and_does_not_nest(gpuctl, make_project, monkeypatch):
    proj = make_project("p", {"train.py": QUICK_TRAIN, ".gpuctlignore": "!.gpuctl/\n!.gpuctl/**\n"})
    home = proj / ".gpuctl"
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    gpuctl("up", "--provider", "local")
    for _ in range(2):
        res = gpuctl("train", str(proj), "--wait")
        assert "refused" in res.stderr and ".gpuctl/: the gpuctl home" in res.stderr, res.stderr
    pushed = [p for p in home.rglob("*") if "/code/" in str(p)]
    assert pushed and not any("/.gpuctl/" in str(p.relative_to(home)) for p in pushed), pushed
    assert not any(p.name.endswith(".pem") or p.name == "ledger.sqlite3" for p in pushed)
    gpuctl("down", "-y")


def _home_project(tmp_path, monkeypatch):
    """The project is the user's HOME (so links to ~/.ssh stay inside it), with keys in it."""
    user = tmp_path / "user"
    (user / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (user / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    (user / ".aws").mkdir(exist_ok=True)
    (user / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = leak\n")
    (user / "train.py").write_text(QUICK_TRAIN)
    (user / "keys").symlink_to(user / ".ssh")
    (user / "creds").symlink_to(user / ".aws" / "credentials")
    (user / ".gpuctlignore").write_text("!.ssh/\n!*\n")
    monkeypatch.setenv("HOME", str(user))
    return user


def test_keys_are_left_out_even_through_links_and_negations(tmp_path, monkeypatch):
    user = _home_project(tmp_path, monkeypatch)
    refused: list[str] = []
    files = scan(user, IgnoreRules.for_project(user), refused=refused)
    assert sorted(files) == [".gpuctlignore", "train.py"], sorted(files)
    assert sorted(refused) == [".aws/: your ~/.aws", ".ssh/: your ~/.ssh", "creds: your ~/.aws",
                               "keys/: your ~/.ssh"], refused


def test_train_from_home_pushes_no_key(gpuctl, tmp_path, monkeypatch):
    user = _home_project(tmp_path, monkeypatch)
    gpuctl("up", "--provider", "local")
    res = gpuctl("train", str(user), "--wait", "--json")
    code = json.loads(res.stdout)["code_sync"]
    assert code["files_total"] == 2 and len(code["refused"]) == 4, code
    (dest,) = (tmp_path / "gpuctl-home" / "clusters" / "default" / "code").glob("user-*")
    assert sorted(os.listdir(dest)) == [".gpuctlignore", "train.py"]
    gpuctl("down", "-y")


def test_a_project_or_data_inside_a_private_place_is_refused(gpuctl, tmp_path, monkeypatch, isolated, make_project):
    gpuctl("up", "--provider", "local")
    user = tmp_path / "user"
    (user / ".aws").mkdir()
    (user / ".aws" / "credentials").write_text("secret")
    proj = make_project("p", {"train.py": QUICK_TRAIN})
    res = gpuctl("train", str(proj), "--data", str(user / ".aws"), code=6)
    assert "is your ~/.aws" in res.stderr and "never pushed" in res.stderr, res.stderr
    (isolated / "train.py").write_text(QUICK_TRAIN)
    res = gpuctl("train", str(isolated), code=6)
    assert "the gpuctl home" in res.stderr and "never pushed" in res.stderr, res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []
    gpuctl("down", "-y")
