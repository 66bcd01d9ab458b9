"""This machine's gpuctl files are private, and a secret reaches a job without
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


PRIVILEGED_OUTPUTS = """
import os
out = os.environ["GPUCTL_OUTPUT_DIR"]
os.makedirs(os.path.join(out, "sub"), exist_ok=True)
for name, mode, text in (("suid", 0o4755, "x"), ("secret", 0o600, "s"), ("sub/sgid", 0o2775, "g")):
    path = os.path.join(out, name)
    with open(path, "w") as fh:
        fh.write(text)
    if os.geteuid() == 0 and name != "sub/sgid":
        os.chown(path, 1234, 1234)  # before the chmod: a chown clears the setuid bit
    os.chmod(path, mode)
if os.geteuid() == 0:
    os.chown(os.path.join(out, "sub"), 1234, 1234)
os.chmod(os.path.join(out, "sub"), 0o1777)
assert os.stat(os.path.join(out, "suid")).st_mode & 0o4000
"""


def test_pull_of_a_local_run_brings_no_setuid_bit_and_no_wider_mode(gpuctl, make_project, tmp_path):
    """No setuid bit and no wider mode, on the local provider's copy (shutil.copy2 kept the setuid bit)."""
    from tests.integration.test_push_pull_safety import assert_pulled_plainly

    gpuctl("up", "--provider", "local")
    proj = make_project("priv", {"train.py": PRIVILEGED_OUTPUTS})
    run_id = json.loads(gpuctl("train", str(proj), "--wait", "--json").stdout)["run"]["run_id"]
    old = os.umask(0o022)
    try:
        dest = tmp_path / "back"
        for _ in range(2):  # a second pull over the first sets the modes again
            gpuctl("pull", run_id, "--dest", str(dest))
            assert_pulled_plainly(dest / run_id / "outputs", "local")
        gpuctl("down", "-y")  # the run is kept under the home: pulled from there the same way
        gpuctl("pull", run_id, "--dest", str(tmp_path / "kept"))
        assert_pulled_plainly(tmp_path / "kept" / run_id / "outputs", "local, kept")
    finally:
        os.umask(old)
