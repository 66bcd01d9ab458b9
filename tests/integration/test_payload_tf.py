"""The real payload with real TensorFlow (tensorflow-cpu): unmodified Keras scripts get one valid
EpochReport line per epoch through the injected callback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuctl.model.records import EpochReport
from gpuctl.ops.guards import PAYLOAD_DIR

pytestmark = pytest.mark.tf  # every test here runs real Keras in the payload

MODEL = """
import numpy as np
import tensorflow as tf
rng = np.random.RandomState(0)
x = rng.rand(100, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int64")
model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                             tf.keras.layers.Dense(2, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def run_payload(tmp_path: Path, script: str, rate: float = 3.6, budget: float = 0.0, args=(), env_extra=None,
                cfg_extra=None, model=MODEL):
    project = tmp_path / "project"
    run_dir = tmp_path / "run"
    project.mkdir(exist_ok=True)
    run_dir.mkdir(exist_ok=True)
    (project / "train.py").write_text(textwrap.dedent(model) + textwrap.dedent(script))
    cfg = {"run_id": "r-tf", "entry": "train.py", "usd_per_hour": rate, "budget_usd": budget,
           "mixed_precision": "auto", "memory_growth": True, "report_path": str(run_dir / "epochs.jsonl"),
           **(cfg_extra or {})}
    (run_dir / "run.json").write_text(json.dumps(cfg))
    env = {"GPUCTL_RUN_DIR": str(run_dir), "GPUCTL_RUN_ID": "r-tf", "PATH": "/usr/bin:/bin",
           "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": str(tmp_path), **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, str(PAYLOAD_DIR / "gpuctl_run.py"), str(run_dir / "run.json"), *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )
    lines = (run_dir / "epochs.jsonl").read_text().splitlines() if (run_dir / "epochs.jsonl").exists() else []
    return proc, [EpochReport.model_validate_json(line) for line in lines], project


# Keras 3 (tf.keras in TF >= 2.16) and Keras 2 (tf_keras, what TF 2.9-2.15 AMIs ship as tf.keras).
KERAS = {"keras3": {}, "keras2": {"TF_USE_LEGACY_KERAS": "1"}}


@pytest.mark.parametrize("keras", sorted(KERAS))
def test_unmodified_fit_reports_every_epoch_across_fit_calls(tmp_path, keras):
    script = """
    assert tf.keras.__name__.startswith("tf_keras") == (KERAS_FLAVOUR == "keras2"), tf.keras.__name__
    import sys
    assert sys.argv[1:] == ["--flag", "a b"], sys.argv
    model.fit(x, y, batch_size=16, epochs=2, validation_split=0.2, verbose=0)
    model.fit(x, y, batch_size=50, epochs=3, initial_epoch=1, verbose=0)  # a second phase: 2 epochs
    open("after_fit.txt", "w").write("ok")
    """
    script = script.replace("KERAS_FLAVOUR", repr(keras))
    proc, reports, project = run_payload(tmp_path, script, rate=3.6, args=("--flag", "a b"), env_extra=KERAS[keras])
    assert proc.returncode == 0, proc.stderr
    assert "no GPU visible to TensorFlow" in proc.stderr
    assert (project / "after_fit.txt").read_text() == "ok"
    assert [r.epoch for r in reports] == [1, 2, 3, 4]
    assert [r.examples for r in reports] == [80, 80, 100, 100]  # validation_split takes 20
    assert all(not r.examples_estimated for r in reports)
    assert [r.epochs_planned for r in reports] == [2, 2, 4, 4]
    total = 0.0
    for r in reports:
        assert r.schema_version == 1 and r.run_id == "r-tf"
        assert r.seconds > 0 and r.end >= r.start
        assert r.seconds == pytest.approx(r.end - r.start)
        assert r.examples_per_s == pytest.approx(r.examples / r.seconds)
        assert r.epoch_cost_usd == pytest.approx(r.seconds * 3.6 / 3600)  # seconds x rate / 3600
        total += r.epoch_cost_usd
        assert r.cumulative_usd == pytest.approx(total)
        assert set(r.metrics) >= {"loss", "accuracy"}
    assert "val_loss" in reports[0].metrics


def test_dataset_input_and_a_script_that_brings_its_own_reporter(tmp_path):
    script = """
    from gpuctl_report import EpochReporter
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(100).batch(32).prefetch(tf.data.AUTOTUNE)
    model.fit(ds, epochs=2, verbose=0, callbacks=[EpochReporter()])
    """
    proc, reports, _ = run_payload(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert [r.epoch for r in reports] == [1, 2]  # its own reporter only: no duplicate lines
    assert [r.examples for r in reports] == [100, 100]  # 3 full batches + 4, counted exactly


def test_budget_stops_training_gracefully(tmp_path):
    script = """
    model.fit(x, y, epochs=50, verbose=0)
    open("saved.txt", "w").write("checkpoint")
    """
    # $36000/h: each tiny epoch costs a few dollars, so a $1 budget stops after the first.
    proc, reports, project = run_payload(tmp_path, script, rate=36000.0, budget=1.0)
    assert proc.returncode == 0, proc.stderr
    assert "budget of $1.0000 reached" in proc.stderr
    assert 1 <= len(reports) < 50
    assert (project / "saved.txt").read_text() == "checkpoint"


def test_a_sigterm_inside_fit_ends_it_at_the_batch_end_and_not_the_code_after_fit(tmp_path):
    """What `stop`, `down` and a guard's budget send: fit ends at the batch end and the script with
    it, as stopped: its code after fit (saving a part-trained model as its final one) does not run,
    its `finally` does; the epoch cut short is neither reported nor checkpointed (a resume redoes
    it whole). A stop that comes after an epoch's last batch (in its validation) keeps that epoch."""
    script = """
    import os, signal
    class Term(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 2 and os.environ.get("WHEN") == "mid-epoch":
                os.kill(os.getpid(), signal.SIGTERM)
        def on_test_begin(self, logs=None):
            if self.epoch == 1 and os.environ.get("WHEN") == "validation":
                os.kill(os.getpid(), signal.SIGTERM)
    try:
        model.fit(x, y, batch_size=10, epochs=50, verbose=0, validation_split=0.2, callbacks=[Term()])
        open("saved.txt", "w").write("final")
    except gpuctl_report.Stopped as stop:
        print("stopped with", stop.code, flush=True)
        raise
    finally:
        print("finally ran", flush=True)
    """
    script = "import gpuctl_report\n" + textwrap.dedent(script)
    for when, kept in (("mid-epoch", 1), ("validation", 2)):
        (tmp_path / when).mkdir()
        ckpt = tmp_path / when / "ckpt"
        proc, reports, project = run_payload(tmp_path / when, script, env_extra={"WHEN": when},
                                             cfg_extra={"checkpoint_dir": str(ckpt)})
        assert "SIGTERM: stopping training after this batch" in proc.stderr, proc.stderr[-2000:]
        assert proc.returncode == 143, proc.stderr[-2000:]
        assert not (project / "saved.txt").exists() and "stopped with 143\nfinally ran" in proc.stdout
        assert "the script's code after fit did not run" in proc.stderr
        assert [r.epoch for r in reports] == list(range(1, kept + 1)) and {r.examples for r in reports} == {80}
        meta = json.loads((ckpt / "fit-0" / "training_metadata.json").read_text())
        assert meta["epoch"] == kept, (when, meta)  # a resume starts at the first epoch not whole


@pytest.mark.parametrize("keras", sorted(KERAS))
def test_each_fit_checkpoints_after_every_epoch_unless_it_cannot(tmp_path, keras):
    """Keras 3 and tf_keras: a BackupAndRestore per fit in the checkpoint dir; a model that is not
    built before fit gets none (keras#20712), with a line saying why, and trains all the same."""
    script = """
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    class Late(tf.keras.Model):  # built only by its first call, inside fit
        def __init__(self):
            super().__init__()
            self.dense = tf.keras.layers.Dense(2, activation="softmax")
        def call(self, inputs):
            return self.dense(inputs)
    late = Late()
    late.compile("adam", "sparse_categorical_crossentropy")
    late.fit(x, y, batch_size=16, epochs=1, verbose=0)
    """
    ckpt = tmp_path / "ckpt"
    proc, reports, _ = run_payload(tmp_path, script, env_extra=KERAS[keras], cfg_extra={"checkpoint_dir": str(ckpt)})
    assert proc.returncode == 0, proc.stderr
    assert [r.epoch for r in reports] == [1, 2, 3]
    assert any((ckpt / "fit-0").rglob("*")), "the built model's fit left no checkpoint"
    assert not (ckpt / "fit-1").exists() or keras == "keras2"  # tf_keras restores into unbuilt models
    if keras == "keras3":
        assert "no checkpoints for this fit: the model is not built before fit" in proc.stderr


@pytest.mark.parametrize("keras", sorted(KERAS))
def test_a_notice_stops_fit_even_past_a_library_sigterm_handler_and_a_peers_error(tmp_path, keras):
    # MultiWorkerMirroredStrategy's coordination service installs TensorFlow's own SIGTERM handler
    # (it only records the signal), and after this worker leaves at its batch end the next
    # collective fails between it and its peers: the run must still end as preempted.
    notice = tmp_path / "notice.json"
    script = """
    import ctypes, os, signal
    ctypes.CDLL(None).signal(signal.SIGTERM, 1)  # a library's own (SIG_IGN), in C, after gpuctl's
    class Leave(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and not os.path.exists(os.environ["NOTICE"]):
                open(os.environ["NOTICE"], "w").write('{"action": "terminate"}')
                os.kill(os.getpid(), signal.SIGTERM)  # what the watchdog does on the notice
        def on_epoch_end(self, epoch, logs=None):
            if self.model.stop_training:
                raise RuntimeError("Collective ops is aborted by: a peer left")
    model.fit(x, y, batch_size=10, epochs=3, verbose=0, callbacks=[Leave()])
    print("after fit: not reached")
    """
    proc, reports, _ = run_payload(tmp_path, script, env_extra={**KERAS[keras], "NOTICE": str(notice)},
                                   cfg_extra={"notice_file": str(notice)})
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert "training stopped on the notice (RuntimeError" in proc.stderr
    assert "after fit" not in proc.stdout and (tmp_path / "run" / "preempted.json").exists()
    assert reports == []  # the cut epoch is not a finished one


STANDALONE_KERAS = """
import os
import numpy as np
import keras  # Keras 3 alone: it imports TensorFlow half-way through its own import
rng = np.random.RandomState(0)
x = rng.rand(100, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int64")
model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(2, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def test_a_standalone_keras_script_reports_and_resumes_from_its_checkpoint(tmp_path):
    """The launcher no longer imports TensorFlow itself; the script's own
    `import keras` returning sets the hooks (reports, checkpoints). Killed at the start of epoch 3,
    the resumed run restores epoch 2's checkpoint and reports epochs 3 and 4."""
    script = """
    class Die(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2 and os.environ.get("DIE"):
                os._exit(9)  # as a SIGKILL: nothing of the launcher's runs after it
    model.fit(x, y, batch_size=20, epochs=4, verbose=0, callbacks=[Die()])
    """
    ckpt = tmp_path / "ckpt"
    proc, reports, _ = run_payload(tmp_path, script, env_extra={"DIE": "1"}, model=STANDALONE_KERAS,
                                   cfg_extra={"checkpoint_dir": str(ckpt)})
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert [r.epoch for r in reports] == [1, 2]
    assert "no GPU visible to TensorFlow" in proc.stderr and any((ckpt / "fit-0").rglob("*"))
    proc, reports, _ = run_payload(tmp_path, script, model=STANDALONE_KERAS,
                                   cfg_extra={"checkpoint_dir": str(ckpt), "resumed": True})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r.epoch for r in reports] == [1, 2, 3, 4]
    assert [r.examples for r in reports] == [100] * 4 and {"loss", "accuracy"} <= set(reports[-1].metrics)


def test_fit_stops_after_the_epochs_asked_and_the_run_ends_there(tmp_path):
    """A plan's probe (`stop_after_epochs`): training stops after K epochs without the script's
    help, and the script's code after fit does not run; the run ends with exit code 0."""
    proc, reports, project = run_payload(tmp_path, """
    model.fit(x, y, batch_size=16, epochs=10, verbose=0)
    open("after_fit.txt", "w").write("ok")
    """, cfg_extra={"stop_after_epochs": 2})
    assert proc.returncode == 0, proc.stderr
    assert [r.epoch for r in reports] == [1, 2] and reports[0].epochs_planned == 10
    assert not (project / "after_fit.txt").exists()
    assert "2 epoch(s) done, as many as this run was to measure" in proc.stderr
