"""Kept runs on the real local provider (real tmux, real files): a run's directory
outlives `down` under the gpuctl home, `pull` and `train --resume --cluster OTHER` still work
from it and `runs rm` deletes it; `pull` lists what it left out, in its output and in --json.

Bad inputs tried: `runs rm` of an unknown run; `pull` of a run whose cluster is down and whose
outputs were kept; `down --pull` when the pull fails (unwritable --dest), with and without
--force; `down --all --pull`; `train --resume` of a kept run on its released cluster; a run's outputs holding absolute and escaping links, a FIFO and a name with an
escape sequence."""

import json
import os

HOSTILE = '''
import os
out = os.environ["GPUCTL_OUTPUT_DIR"]
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "model.txt"), "w").write("weights\\n")
os.symlink("model.txt", os.path.join(out, "alias"))
os.symlink("/etc/passwd", os.path.join(out, "passwd"))
os.symlink("../../../..", os.path.join(out, "up"))
os.symlink("/etc", os.path.join(out, "esc\\x1b[31mred"))
os.mkfifo(os.path.join(out, "pipe"))
print("done", flush=True)
'''


def test_local_pull_lists_what_it_left_out_in_json_and_output(gpuctl, make_project, isolated):
    gpuctl("up")
    proj = make_project("hostile", {"train.py": HOSTILE})
    run = json.loads(gpuctl("train", proj, "--wait", "--json").stdout)["run"]
    dest = isolated.parent / "back"
    skipped = json.loads(gpuctl("pull", run["run_id"], "--dest", dest, "--json").stdout)["skipped"]
    for name, why in {"passwd": "a link leading out of the run (/etc/passwd)", "up": "a link leading out",
                      "esc": "a link leading out of the run (/etc)", "pipe": "not a regular file"}.items():
        assert any(e.startswith(f"outputs/{name}") and why in e for e in skipped), (name, skipped)
    assert not any(c < " " for e in skipped for c in e), skipped
    got = dest / run["run_id"] / "outputs"
    assert (got / "model.txt").read_text() == "weights\n" and os.readlink(got / "alias") == "model.txt"
    assert not any(os.path.lexists(got / n) for n in ("passwd", "up", "pipe"))
    err = gpuctl("pull", run["run_id"], "--dest", dest).stderr
    assert "entries not pulled (4)" in err and "\x1b" not in err


# A run that checkpoints as the launcher's Keras hook would (outputs/checkpoint/...), without TF:
# a resumed run finds its checkpoint and says so.
CHECKPOINTS = '''
import os, sys
out = os.environ["GPUCTL_OUTPUT_DIR"]
ckpt = os.path.join(out, "checkpoint")
if os.path.isdir(ckpt):
    print("resumed from", sorted(os.listdir(ckpt)), flush=True)
    sys.exit(0)
os.makedirs(ckpt)
open(os.path.join(ckpt, "chief"), "w").write("epoch 1\\n")
open(os.path.join(out, "model.txt"), "w").write("weights\\n")
print("first attempt fails", flush=True)
sys.exit(3)
'''


def test_local_down_keeps_each_runs_directory_for_pull_resume_elsewhere_and_runs_rm(gpuctl, make_project,
                                                                                    isolated):
    gpuctl("up", "--name", "one")
    proj = make_project("ckpt", {"train.py": CHECKPOINTS})
    gpuctl("train", proj, "--cluster", "one", "--wait", code=8)  # the run failed: its exit code 3
    run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    # The prompt says what becomes of the runs' files (refused here: no terminal, no -y).
    asked = gpuctl("down", "one", code=2).stderr
    assert f"kept in {isolated / 'runs'}" in asked
    gpuctl("down", "one", "-y")
    kept = isolated / "runs" / run_id
    assert (kept / "outputs" / "checkpoint" / "chief").is_file()
    assert kept.stat().st_mode & 0o777 == 0o700 and (isolated / "runs").stat().st_mode & 0o777 == 0o700
    # pull of a run whose cluster is down and whose outputs were kept
    back = isolated.parent / "back"
    pulled = json.loads(gpuctl("pull", run_id, "--dest", back, "--json").stdout)
    assert pulled["files"] >= 3 and (back / run_id / "outputs" / "model.txt").read_text() == "weights\n"
    assert "first attempt fails" in (back / run_id / "output.log").read_text()
    # Resume on its own (released) cluster: refused, naming --cluster.
    assert "--cluster OTHER" in gpuctl("train", "--resume", run_id, code=4).stderr
    gpuctl("up", "--name", "two")
    gpuctl("train", "--resume", run_id, "--cluster", "two")
    gpuctl("logs", "-f", run_id)
    assert "resumed from ['chief']" in gpuctl("logs", run_id).stdout
    # runs rm while it is on cluster two: its directory there and the copy kept from one both go.
    gpuctl("runs", "rm", run_id, "-y")
    assert not (isolated / "runs" / run_id).exists()
    assert not (isolated / "clusters" / "two" / "runs" / run_id).exists()
    gpuctl("down", "two", "-y")
    assert not (isolated / "runs" / run_id).exists()
    assert "no run named" in gpuctl("runs", "rm", "nope-123", "-y", code=4).stderr


def test_down_pull_brings_every_run_back_first_and_a_failed_pull_blocks_only_without_force(gpuctl, quick_project,
                                                                                         isolated):
    gpuctl("up")
    run_id = json.loads(gpuctl("train", quick_project, "--wait", "--json").stdout)["run"]["run_id"]
    # down --pull when the pull fails: nothing is released...
    err = gpuctl("down", "--pull", "--dest", "/proc/nope", "-y", code=3).stderr
    assert f"cannot pull run {run_id} before releasing 'default'" in err and "--force" in err
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "up"
    # ...unless --force: the release goes on, and says what was not pulled.
    gpuctl("train", quick_project, "--wait")
    back = isolated.parent / "back"
    res = json.loads(gpuctl("down", "--pull", "--dest", back, "-y", "--json").stdout)
    assert run_id in res["pulled"] and len(res["pulled"]) == 2
    assert (back / run_id / "epochs.jsonl").read_text().count("\n") == 2
    gpuctl("up")
    gpuctl("train", quick_project, "--wait")
    res = gpuctl("down", "--pull", "--dest", "/proc/nope", "--force", "-y")
    assert "not pulled" in res.stderr and "is down" in res.stdout
    assert "--pull goes with one cluster" in gpuctl("down", "--all", "--pull", "-y", code=2).stderr
