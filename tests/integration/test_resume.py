"""`gpuctl train --resume RUN`, on local and on a real sshd host: a job (6 epochs) killed with
SIGKILL in the middle of epoch 3 starts again from its checkpoint, as the same run, and ends with
epochs 1-6 each reported once. The test on local (marked tf) runs an unmodified Keras script with
real TensorFlow, resumed from the checkpoint the launcher added (BackupAndRestore after each
epoch); the others run a plain-Python job that checkpoints and reports the same way (RESUMABLE),
since what they prove (another cluster, an ssh host) is gpuctl's, not Keras's.

Bad inputs tried: --resume of an unknown run, of a succeeded run, of a run without a checkpoint
(train.checkpoint = "off"), of a run whose cluster was released, and --resume with a PATH or
script ARGS (it runs the run as it was)."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from tests.integration.test_payload_tf import MODEL
from tests.integration.test_ssh import up_ssh
from tests.waits import wait_for

# Each epoch takes ~3.5 s (a pause per batch), so a kill lands inside one even when looking at
# the run over SSH takes a second.
SLOW = textwrap.dedent(MODEL) + textwrap.dedent("""
    import sys, time
    class Slow(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.5)
    model.fit(x, y, batch_size=16, epochs=int(sys.argv[sys.argv.index("--epochs") + 1]), verbose=2,
              callbacks=[Slow()])
    print("final accuracy", model.evaluate(x, y, verbose=0)[1])
""")

# A plain-Python job that resumes as the Keras one does: epochs numbered on from its checkpoint
# ($GPUCTL_OUTPUT_DIR/checkpoint, where the launcher's hook keeps Keras's). Started fresh, it
# stops in epoch 3 until it is killed (a barrier, not a race against a sleep); the checkpoint of an
# epoch is written before its report, so a report seen means a checkpoint there.
RESUMABLE = """
import os, sys, time
import gpuctl_report

epochs = int(sys.argv[sys.argv.index("--epochs") + 1])
cfg = gpuctl_report.run_config()
writer = gpuctl_report.ReportWriter.shared(cfg["report_path"], cfg["run_id"], cfg["usd_per_hour"])
ckpt = os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "checkpoint")
os.makedirs(ckpt, exist_ok=True)
mark = os.path.join(ckpt, "epoch")
done = int(open(mark).read()) if os.path.exists(mark) else 0
writer.resume_at(done)
for epoch in range(done, epochs):
    if epoch == 2 and done == 0:
        print("in epoch 3: waiting to be killed", flush=True)
        while True:
            time.sleep(0.1)
    start = time.time()
    time.sleep(0.1)
    with open(mark + ".tmp", "w") as fh:
        fh.write(str(epoch + 1))
    os.replace(mark + ".tmp", mark)
    writer.write(start, time.time(), 100, False, epochs, {"accuracy": 0.5})
    print("Epoch %d/%d" % (epoch + 1, epochs), flush=True)
print("final accuracy 0.5", flush=True)
"""


def _status(gpuctl, run_id):
    return next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)


def _kill_mid_epoch_3(gpuctl, kill, run_id, keras=False):
    wait_for(lambda: _status(gpuctl, run_id)["epoch"] >= 2, 180, "epoch 2")
    if keras:
        time.sleep(0.6)  # into epoch 3 (its checkpoint of epoch 2 is written right after the report)
    kill(f"pkill -9 -f 'runs/{run_id}/run[.]json'")
    wait_for(lambda: _status(gpuctl, run_id)["state"] != "running", 180, "the killed run's end")
    run = _status(gpuctl, run_id)
    assert run["state"] == "failed" and run["exit_code"] == 137 and run["epoch"] == 2
    # status offers the way back.
    assert run["resumable"] and f"gpuctl train --resume {run_id}" in gpuctl("status").stdout
    return run


def _resume_and_check(gpuctl, run_id, resumed=False):
    if resumed:  # already: follow it to its end
        res = gpuctl("logs", "-f", run_id)
        assert "final accuracy" in res.stdout
    else:
        res = gpuctl("train", "--resume", run_id, "--wait")
        assert f"Run {run_id} resumed from its checkpoint" in res.stderr
    assert "final accuracy" in res.stdout
    run = _status(gpuctl, run_id)
    assert run["state"] == "succeeded" and run["epoch"] == 6 and run["epochs_planned"] == 6
    assert not run["resumable"] and "--resume" not in gpuctl("status").stdout
    cost = json.loads(gpuctl("cost", "--json", run_id).stdout)["runs"][0]
    assert [e["epoch"] for e in cost["epochs"]] == [1, 2, 3, 4, 5, 6]  # each once, numbered on
    dollars = [e["cumulative_usd"] for e in cost["epochs"]]
    assert dollars == sorted(dollars)  # the resumed epochs go on counting from epoch 2's total


@pytest.mark.tf
def test_resume_on_local_after_a_sigkill_mid_epoch(gpuctl, make_project, tmp_path):
    import subprocess

    gpuctl("up", "--provider", "local", "--usd-per-hour", "3.6", "-y")
    proj = make_project("slow", {"train.py": SLOW})
    run_id = json.loads(gpuctl("train", proj, "--json", "--", "--epochs", "6").stdout)["run"]["run_id"]
    _kill_mid_epoch_3(gpuctl, lambda cmd: subprocess.run(["sh", "-c", cmd]), run_id, keras=True)
    _resume_and_check(gpuctl, run_id)

    # Bad inputs: each refused before anything starts.
    assert "cannot resume run" in gpuctl("train", "--resume", run_id, code=5).stderr  # succeeded
    assert "nothing to resume" in gpuctl("train", "--resume", run_id, code=5).stderr
    assert "no run" in gpuctl("train", "--resume", "nope-1", code=4).stderr.lower()
    res = gpuctl("train", "--resume", run_id, str(proj), code=2)
    assert "--resume runs the run as it was: PATH" in res.stderr
    res = gpuctl("train", "--resume", run_id, "--", "--epochs", "9", code=2)
    assert "ARGS" in res.stderr
    gpuctl("down", "-y")


# Stopped (`gpuctl stop`: SIGTERM) in the middle of epoch 2 of 3: it holds at its third batch of
# epoch 2 until the stop reaches it (a barrier, not a race against a sleep), once: a resume finds
# its mark. The model it saves after fit is its final one, so that must come from a whole run.
STOPPABLE = textwrap.dedent(MODEL) + textwrap.dedent("""
    import os, time
    import gpuctl_report
    out = os.environ["GPUCTL_OUTPUT_DIR"]
    class Hold(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_end(self, batch, logs=None):
            mark = os.path.join(out, "held")
            if self.epoch == 1 and batch == 2 and not os.path.exists(mark):
                open(mark, "w").close()
                print("in epoch 2: waiting to be stopped", flush=True)
                deadline = time.time() + 120
                while not gpuctl_report.stop_requested() and time.time() < deadline:
                    time.sleep(0.05)
    try:
        model.fit(x, y, batch_size=10, epochs=3, verbose=0, callbacks=[Hold()])
        model.save_weights(os.path.join(out, "final.weights.h5"))
        open(os.path.join(out, "final.txt"), "w").write("trained")
        print("final accuracy", model.evaluate(x, y, verbose=0)[1])
    finally:
        print("the script's finally ran", flush=True)
""")


@pytest.mark.tf
def test_a_stopped_run_resumes_at_the_epoch_it_cut_and_saves_no_final_model_before(gpuctl, make_project, tmp_path):
    """`gpuctl stop` mid-epoch, then `train --resume`: the cut epoch is done again whole (Keras 3's
    BackupAndRestore restores whole epochs only), each epoch reported once with all its examples;
    the script's code after fit runs only at the real end, its `finally` on the stop too; the cut
    part's dollars show as lost work, never as a free epoch."""
    gpuctl("up", "--provider", "local", "--usd-per-hour", "3.6", "-y")
    proj = make_project("stoppable", {"train.py": STOPPABLE})
    run_id = json.loads(gpuctl("train", proj, "--json").stdout)["run"]["run_id"]
    wait_for(lambda: "waiting to be stopped" in gpuctl("logs", run_id).stdout, 120, "epoch 2's hold")
    gpuctl("stop", run_id)
    run = _status(gpuctl, run_id)
    assert run["state"] == "stopped" and run["exit_code"] == 143 and run["epoch"] == 1, run
    log = gpuctl("logs", run_id).stdout
    assert "the script's finally ran" in log and "final accuracy" not in log, log[-2000:]
    outputs = next(tmp_path.rglob(f"runs/{run_id}/outputs"))
    assert (outputs / "held").exists() and not (outputs / "final.txt").exists()  # no half-trained model as final
    assert f"`gpuctl train --resume {run_id}` continues from the last whole epoch" in gpuctl("logs", "--raw", run_id).stdout

    res = gpuctl("train", "--resume", run_id, "--wait")
    assert f"Run {run_id} resumed from its checkpoint" in res.stderr and "final accuracy" in res.stdout
    assert (outputs / "final.txt").read_text() == "trained"
    rc = json.loads(gpuctl("cost", "--json", run_id).stdout)["runs"][0]
    assert [e["epoch"] for e in rc["epochs"]] == [1, 2, 3]  # the cut epoch 2 is not skipped
    assert [e["examples"] for e in rc["epochs"]] == [100, 100, 100]  # and is whole
    assert [g["end"] for g in rc["segments"]] == ["stopped", "succeeded"]
    # The cut part of epoch 2 (its hold included) is lost work, billed; no epoch is counted twice.
    assert rc["lost_s"] > 0 and rc["lost_usd"] > 0
    assert rc["spent_usd"] == pytest.approx(sum(e["epoch_cost_usd"] for e in rc["epochs"]))
    assert rc["instances_usd"] >= rc["spent_usd"] + rc["lost_usd"] - 1e-9
    gpuctl("down", "-y")


def test_resume_on_another_cluster(gpuctl, make_project):
    """`train --resume RUN --cluster B`: the checkpoint and reports go from the run's host to B's
    (through here: local and ssh clusters share no store), and the run goes on there as itself."""
    import subprocess

    gpuctl("up", "--provider", "local", "--name", "a", "--usd-per-hour", "3.6", "-y")
    proj = make_project("resumable", {"train.py": RESUMABLE})
    run_id = json.loads(gpuctl("train", proj, "--json", "--", "--epochs", "6").stdout)["run"]["run_id"]
    _kill_mid_epoch_3(gpuctl, lambda cmd: subprocess.run(["sh", "-c", cmd]), run_id)
    gpuctl("up", "--provider", "local", "--name", "b", "--usd-per-hour", "7.2", "-y")
    assert "no cluster" in gpuctl("train", "--resume", run_id, "--cluster", "zz", code=4).stderr.lower()
    res = gpuctl("train", "--resume", run_id, "--cluster", "b")
    assert "checkpoint: pushed 1 of 1 files" in res.stderr and "resumed on local-b" in res.stderr
    assert f"Run {run_id} resumed from its checkpoint on b." in res.stdout
    _resume_and_check(gpuctl, run_id, resumed=True)
    run = _status(gpuctl, run_id)
    assert run["cluster"] == "b" and [g["end"] for g in run["segments"]] == ["failed", "succeeded"]
    assert [g["usd_per_hour"] for g in run["segments"]] == [3.6, 7.2]
    gpuctl("down", "--all", "-y")


def test_a_run_without_a_checkpoint_is_not_resumed(gpuctl, make_project, monkeypatch):
    monkeypatch.setenv("GPUCTL_TRAIN__CHECKPOINT", "off")
    gpuctl("up", "--provider", "local", "-y")
    proj = make_project("nockpt", {"train.py": "raise SystemExit(3)\n"})
    res = gpuctl("train", proj, "--wait", code=8)
    run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    res = gpuctl("train", "--resume", run_id, code=4)
    assert "has no checkpoint" in res.stderr and "Hint:" in res.stderr
    assert _status(gpuctl, run_id)["state"] == "failed"  # nothing started
    gpuctl("down", "-y")
    assert not _status(gpuctl, run_id)["resumable"]  # its cluster is gone
    res = gpuctl("train", "--resume", run_id, code=4)
    assert "is gone, and its checkpoint with it" in res.stderr


def test_resume_on_an_ssh_host_after_a_sigkill_mid_epoch(gpuctl, ssh, make_project):
    host = ssh.hosts[0]
    up_ssh(gpuctl, ssh, extra=("--usd-per-hour", "3.6"))
    proj = make_project("resumable", {"train.py": RESUMABLE})
    run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json", "--", "--epochs", "6").stdout)["run"]["run_id"]
    _kill_mid_epoch_3(gpuctl, host.run, run_id)
    _resume_and_check(gpuctl, run_id)
    gpuctl("down", "-y")
