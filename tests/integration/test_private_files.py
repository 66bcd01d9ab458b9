"""Issue 11, item 6: this machine's gpuctl files are private, and a secret reaches a job without
being recorded. Local provider (this machine plays the instance), the real CLI and tmux.

Bad inputs tried: `--env 1BAD` (not a name), `--env NOT_SET_HERE`, `--env GPUCTL_RUN_ID` (gpuctl's
own), each refused before anything is pushed or started; a home left at 0755 with 0644 files by
an older gpuctl (fixed on the next command)."""

from __future__ import annotations

import json
import os
import stat

from tests.conftest import QUICK_TRAIN

SECRET = "hf_s3cr3t-value-that-must-not-be-recorded"

ENV_TRAIN = QUICK_TRAIN + """
import os
print("token length", len(os.environ.get("HF_TOKEN", "")), flush=True)
"""


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_home_and_its_files_are_the_owners_alone(gpuctl, make_project, isolated):
    old = isolated
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    (old / "notes.txt").write_text("x")
    os.chmod(old / "notes.txt", 0o644)
    gpuctl("status")
    assert mode(old) == 0o700 and mode(old / "notes.txt") == 0o600  # an older home, fixed
    gpuctl("up", "--provider", "local")
    proj = make_project("p", {"train.py": QUICK_TRAIN})
    run_id = json.loads(gpuctl("train", str(proj), "--wait", "--json").stdout)["run"]["run_id"]
    gpuctl("down", "-y")  # archives the run's log under the home
    assert mode(isolated / "ledger.sqlite3") == 0o600
    assert mode(isolated / "logs" / f"{run_id}.log") == 0o600
    others = [p for p in isolated.rglob("*") if not p.is_symlink() and mode(p) & 0o077]
    assert mode(isolated) == 0o700 and all(not (mode(p.parent) & 0o077) for p in others), others


def test_train_env_passes_a_secret_without_recording_it(gpuctl, make_project, isolated, monkeypatch):
    gpuctl("up", "--provider", "local")
    proj = make_project("secret", {"train.py": ENV_TRAIN})
    for bad, needle in [("1BAD", "is not an environment variable name"), ("NOT_SET_HERE", "not set here"),
                        ("GPUCTL_RUN_ID", "gpuctl sets that one itself")]:
        res = gpuctl("train", str(proj), "--env", bad, code=3)
        assert needle in res.stderr and "Traceback" not in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []  # nothing started
    monkeypatch.setenv("HF_TOKEN", SECRET)
    run = json.loads(gpuctl("train", str(proj), "--env", "HF_TOKEN", "--wait", "--json").stdout)["run"]
    assert run["state"] == "succeeded" and run["env_names"] == ["HF_TOKEN"]
    assert f"token length {len(SECRET)}" in gpuctl("logs", run["run_id"]).stdout
    # Nowhere on disk: not in the ledger (WAL included), not in the job's script or its run dir.
    for path in isolated.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path
