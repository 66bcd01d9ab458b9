"""Issue 37, item 6, on the local provider with real tmux: `cost --cluster` filters as `status
--cluster` does; `down --all` with nothing up says so; `status` offers `train --resume` only for a
run that wrote a checkpoint. (End of input at a prompt: tests/integration/test_cli.py, Ctrl-D.)

Bad inputs tried by hand: `cost --cluster nope` (exit 4, "no cluster named 'nope'", as status),
`cost --cluster ''` (the same), `down --all -y` twice."""

from __future__ import annotations

import json

from tests.conftest import QUICK_TRAIN

FAILS_AT_ONCE = "raise SystemExit('bad data')\n"
# Writes a checkpoint file where the launcher's Keras callback would, then fails.
CHECKPOINTS_THEN_FAILS = """
import os
import gpuctl_report
cfg = gpuctl_report.run_config()
os.makedirs(cfg["checkpoint_dir"], exist_ok=True)
open(os.path.join(cfg["checkpoint_dir"], "chief.ckpt"), "w").write("weights")
raise SystemExit("out of memory")
"""


def test_cost_cluster_filters_as_status_cluster_does(gpuctl, make_project):
    proj = make_project("p", {"train.py": QUICK_TRAIN})
    gpuctl("up", "--name", "a", "-y")
    gpuctl("train", proj, "--cluster", "a", "--wait")
    gpuctl("up", "--name", "b", "-y")
    gpuctl("train", proj, "--cluster", "b", "--wait")
    report = json.loads(gpuctl("cost", "--cluster", "a", "--json").stdout)
    assert [c["name"] for c in report["clusters"]] == ["a"]
    assert {r["run_id"].split("-")[0] for r in report["runs"]} == {"p"} and len(report["runs"]) == 1
    status = json.loads(gpuctl("status", "--cluster", "a", "--json").stdout)
    assert [r["run_id"] for r in status["runs"]] == [r["run_id"] for r in report["runs"]]
    for command in ("status", "cost"):
        res = gpuctl(command, "--cluster", "nope", code=4)
        assert "no cluster named 'nope'" in res.stderr


def test_down_all_twice_says_nothing_is_up(gpuctl):
    gpuctl("up", "-y")
    gpuctl("down", "--all", "-y")
    out = gpuctl("down", "--all", "-y").stdout
    assert "No cluster is up; nothing to do." in out and "'*'" not in out


def test_status_offers_resume_only_for_a_run_that_wrote_a_checkpoint(gpuctl, make_project):
    gpuctl("up", "-y")
    gpuctl("train", make_project("never", {"train.py": FAILS_AT_ONCE}), "--wait", code=8)
    assert "train --resume" not in gpuctl("status").stdout
    gpuctl("train", make_project("wrote", {"train.py": CHECKPOINTS_THEN_FAILS}), "--wait", code=8)
    out = gpuctl("status").stdout
    assert out.count("train --resume") == 1 and "train --resume wrote-" in out, out
