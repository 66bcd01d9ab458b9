"""Per-epoch time and cost reports, written on the instance. Stdlib + TensorFlow only; Python 3.8+.

gpuctl's launcher injects `EpochReporter` into every `Model.fit`; a script that wants control can
`from gpuctl_report import EpochReporter` and pass it itself (the launcher then adds no second
one). A custom training loop (tf.GradientTape) reports through the public API below, `epoch` or
`report_epoch`, a no-op off gpuctl. Each finished epoch appends one JSON line (schema
`gpuctl_protocol.EPOCH_SCHEMA_VERSION`) to the run's epochs.jsonl: start/end, seconds, examples and examples/s, dollars
per hour, the epoch's cost, the run's cumulative cost, the metrics, and the GPU's utilisation and
memory while it ran (gpuctl_gpu.py) where nvidia-smi answers.

A run may be told to stop after some epochs (`stop_after_epochs` in run.json: `gpuctl plan`'s
probes): after that epoch is reported the script ends there, with exit code 0, whether it uses
`fit` (its training stops, then the run ends when `fit` returns) or the API (the report raises
`EnoughEpochs`, a SystemExit).
"""

import json
import math
import os
import sys
import time
from typing import Any, Dict, Tuple

import gpuctl_protocol  # beside this file (copied into a project, it needs this one beside it too)

try:  # now, while the payload's directory is on sys.path (the user's script's replaces it later)
    import gpuctl_gpu
except ImportError:  # this file copied into a project, off gpuctl: no sampling (nor reports) there
    gpuctl_gpu = None  # type: ignore[assignment]  # the module or None: checked before each use

# Set by the launcher: a fit is running; a graceful stop (SIGTERM) was asked for; it came with a
# spot interruption notice; it cut an epoch short at a batch end (`cut`: that epoch is not a
# finished one, neither reported nor checkpointed, and a resumed run does it again whole).
STATE = {"in_fit": False, "stop_requested": False, "resumed": False, "fits_begun": False, "preempted": False,
         "enough": False, "cut": False}


def epoch_cut():
    """True when the epoch ending now was cut short by a stop or a spot notice."""
    return bool(STATE["preempted"] or STATE["cut"])


class Stopped(SystemExit):
    """Raised out of `fit` (exit code 143) when `gpuctl stop`, `down` or a guard stopped training:
    the script's code after fit (saving its final model) is not run on a model trained part-way;
    its `finally` blocks are. `train --resume RUN` continues from the last whole epoch."""


class EnoughEpochs(SystemExit):
    """Ends the script after the last epoch it was to run (`stop_after_epochs`, or its budget):
    a SystemExit, so the script's `except Exception` lets it through and its `finally` runs."""


def stop_requested():
    """True once gpuctl asked this run to stop while `fit` ran (a callback may look; `fit` then
    raises Stopped at its end). Outside `fit` the stop raises Stopped at once."""
    return STATE["stop_requested"]


def settings():
    """The run's gpuctl_protocol.RunConfig (run.json in $GPUCTL_RUN_DIR); its defaults off gpuctl."""
    run_dir = os.environ.get("GPUCTL_RUN_DIR")
    if not run_dir:
        return gpuctl_protocol.RunConfig()
    return gpuctl_protocol.RunConfig.load(os.path.join(run_dir, gpuctl_protocol.RUN_CONFIG_FILE))


def run_config():
    """The same as a dict, for scripts that write their reports through ReportWriter; {} off gpuctl."""
    return settings().to_dict() if os.environ.get("GPUCTL_RUN_DIR") else {}


if gpuctl_gpu is not None and os.environ.get("GPUCTL_RUN_DIR"):
    # Under gpuctl (the launcher imports this first): sampling starts with the job, so the first
    # epoch has its readings too, however the script reports it.
    gpuctl_gpu.sampler(settings().gpu_sample_s)


def _number(value):
    """A JSON-safe float for a metric (numpy/TF scalars included), or None."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# When this module was loaded: under gpuctl the launcher loads it before the script runs, so a
# first epoch reported with no timing of its own counts from the script's start.
LOADED_AT = time.time()


class ReportWriter(object):
    """Turns epoch timings into report lines and appends them; one per report file per process."""

    _by_path: Dict[Tuple[Any, ...], "ReportWriter"] = {}

    def __init__(self, path, run_id, usd_per_hour, budget_usd=0.0, stop_after=None):
        cfg = settings()
        self.path = path
        self.run_id = run_id
        self.usd_per_hour = float(usd_per_hour)
        self.budget_usd = float(budget_usd or 0.0)
        self.stop_after = _positive_int(cfg.stop_after_epochs if stop_after is None else stop_after)
        self.gpu = gpuctl_gpu.sampler(cfg.gpu_sample_s) if gpuctl_gpu is not None else None
        self.epochs_done = 0
        self.cumulative_usd = 0.0
        self.last_end = None  # when the last epoch this process reported ended
        # A resumed run (train --resume) goes on counting from what its report file holds.
        self.history = {0: 0.0}  # epoch -> cumulative $ after it
        for report in self._earlier():
            self.history[report["epoch"]] = report["cumulative_usd"]
            self.epochs_done, self.cumulative_usd = report["epoch"], report["cumulative_usd"]

    def _earlier(self):
        try:
            with open(self.path) as fh:
                lines = fh.read().splitlines()
        except (OSError, UnicodeDecodeError):
            return []
        out = []
        for line in lines:
            try:
                report = json.loads(line)
                if report.get("run_id") == self.run_id:
                    out.append({"epoch": int(report["epoch"]), "cumulative_usd": float(report["cumulative_usd"])})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        return out

    def resume_at(self, epoch):
        """A resumed fit restarts at `epoch` (0-based, from its checkpoint): count from there, so
        an epoch reported before the interruption but not checkpointed is reported once more
        under its own number (the ledger keeps the first) and never shifts the numbers after it."""
        self.epochs_done = epoch
        self.cumulative_usd = self.history.get(epoch, self.cumulative_usd)

    @classmethod
    def shared(cls, path, run_id, usd_per_hour, budget_usd=0.0, stop_after=None):
        """One writer per file, so several `fit` calls in a run keep counting epochs and dollars."""
        key = os.path.abspath(path)
        if key not in cls._by_path:
            cls._by_path[key] = cls(path, run_id, usd_per_hour, budget_usd, stop_after)
        return cls._by_path[key]

    def write(self, start, end, examples, examples_estimated, epochs_planned, metrics):
        seconds = max(0.0, end - start)
        self.last_end = end
        cost = seconds * self.usd_per_hour / 3600.0
        self.epochs_done += 1
        self.cumulative_usd += cost
        report = {
            "schema": gpuctl_protocol.EPOCH_SCHEMA_VERSION,
            "run_id": self.run_id,
            "epoch": self.epochs_done,
            "epochs_planned": epochs_planned,
            "start": start,
            "end": end,
            "seconds": seconds,
            "examples": examples,
            "examples_estimated": bool(examples_estimated),
            "examples_per_s": (examples / seconds) if (examples and seconds > 0) else None,
            "usd_per_hour": self.usd_per_hour,
            "epoch_cost_usd": cost,
            "cumulative_usd": self.cumulative_usd,
            "metrics": dict((k, _number(v)) for k, v in sorted((metrics or {}).items())),
        }
        if self.gpu is not None:
            report.update(self.gpu.between(start, end))
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            os.makedirs(directory)
        # One write() of one line in append mode: readers never see half a line.
        with open(self.path, "a") as fh:
            fh.write(json.dumps(report, sort_keys=True) + "\n")
        return report

    def budget_exhausted(self, last_cost):
        """True when the next epoch, costing about what the last did, would cross the budget."""
        return self.budget_usd > 0 and self.cumulative_usd + last_cost > self.budget_usd

    def enough(self):
        """True once the run has done the epochs it was to do (`stop_after_epochs`): said once."""
        done = self.stop_after is not None and self.epochs_done >= self.stop_after
        if done and not STATE["enough"]:
            STATE["enough"] = True
            log("%d epoch(s) done, as many as this run was to measure (gpuctl plan): ending the run here"
                 % self.epochs_done)
        return done


def _positive_int(value):
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n >= 1 else None


def log(msg):
    """A line of gpuctl's own on the run's stderr (its log), told apart by its prefix."""
    sys.stderr.write("gpuctl: %s\n" % msg)
    sys.stderr.flush()


def count_examples(x=None, batch_size=None, validation_split=0.0, steps_per_epoch=None):
    """(examples per epoch or None, batch size or None) for what `fit` was given; best effort."""
    n, bs = None, batch_size
    if x is not None and hasattr(x, "element_spec"):  # a tf.data.Dataset
        n, bs = _dataset_counts(x)
    elif x is not None:
        first = x
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, dict) and first:
            first = next(iter(first.values()))
        try:
            n = int(first.shape[0]) if hasattr(first, "shape") else len(first)
        except (TypeError, IndexError):
            n = None
        if n is not None and validation_split:
            n = int(math.ceil(n * (1.0 - validation_split)))
        bs = bs or 32  # Keras's default batch size for arrays
    if steps_per_epoch and bs:
        n = min(n, steps_per_epoch * bs) if n is not None else None
    return n, bs


def _dataset_counts(ds):
    """Walk a tf.data pipeline down to its batch() stage: (unbatched size if finite, batch size)."""
    node, depth = ds, 0
    while node is not None and depth < 50:
        bs = getattr(node, "_batch_size", None)
        if bs is not None:
            try:
                batch = int(bs)
                inner = node._input_dataset.cardinality()
                n = int(inner)
                return (n if n >= 0 else None), batch
            except Exception:
                return None, None
        node = getattr(node, "_input_dataset", None)
        depth += 1
    return None, None


_classes: Dict[type, type] = {}


def reporter_class(callback_base):
    """EpochReporter built on the given Keras `Callback` base (Keras 2, Keras 3 or tf_keras)."""
    if callback_base in _classes:
        return _classes[callback_base]

    class EpochReporter(callback_base):  # type: ignore[valid-type,misc]  # Keras's base, known at run time
        _gpuctl_reporter = True

        def __init__(self, path=None, run_id=None, usd_per_hour=None, budget_usd=None):
            super(EpochReporter, self).__init__()
            cfg = settings()
            self.writer = ReportWriter.shared(
                path or cfg.report_path or "epochs.jsonl",
                run_id or cfg.run_id,
                cfg.usd_per_hour if usd_per_hour is None else usd_per_hour,
                cfg.budget_usd if budget_usd is None else budget_usd,
            )
            self.examples_per_epoch = None
            self.batch_size = None
            self.examples_estimated = True
            self._first_epoch_done = 0
            self._initial = None
            self._planned_total = None

        def expect(self, examples_per_epoch, batch_size):
            """Told by the fit hook what one epoch holds, so examples/s is exact where it can be."""
            self.examples_per_epoch = examples_per_epoch
            self.batch_size = batch_size
            self.examples_estimated = examples_per_epoch is None

        def on_train_begin(self, logs=None):
            # Epochs reported by earlier fit calls of this run count towards the plan too.
            self._first_epoch_done = self.writer.epochs_done
            self._initial = None
            self._planned_total = (getattr(self, "params", None) or {}).get("epochs")

        def on_epoch_begin(self, epoch, logs=None):
            if self._initial is None:
                self._initial = epoch
                if STATE.get("resumed") and not STATE.get("fits_begun"):
                    # The first fit of a resumed run, restored from its checkpoint at `epoch`
                    # (0 when there was none to restore): its epochs are numbered from there.
                    self.writer.resume_at(epoch)
                    self._first_epoch_done = epoch
                STATE["fits_begun"] = True
            self._start = time.time()
            self._steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self._steps += 1
            if STATE["stop_requested"] and not self.model.stop_training:
                # Keras restores whole epochs only (its BackupAndRestore keeps the epoch a step
                # checkpoint was in, not the step): an epoch left before its last batch is redone.
                steps = (getattr(self, "params", None) or {}).get("steps")
                STATE["cut"] = not steps or batch + 1 < steps
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            if epoch_cut():
                return  # cut short: it runs again, whole, when the run is resumed
            if STATE["stop_requested"]:
                self.model.stop_training = True  # asked after its last batch: a whole epoch, kept
            end = time.time()
            examples = None
            if self.batch_size:
                examples = self._steps * self.batch_size
                if self.examples_per_epoch is not None:
                    examples = min(examples, self.examples_per_epoch)
            elif self.examples_per_epoch is not None:
                examples = self.examples_per_epoch
            planned = None
            if self._planned_total is not None:
                planned = self._first_epoch_done + self._planned_total - (self._initial or 0)
            report = self.writer.write(
                self._start, end, examples, self.examples_estimated, planned, logs or {}
            )
            if self.writer.budget_exhausted(report["epoch_cost_usd"]):
                sys.stderr.write(
                    "gpuctl: budget of $%.4f reached after $%.4f: stopping training after epoch %d\n"
                    % (self.writer.budget_usd, self.writer.cumulative_usd, report["epoch"])
                )
                self.model.stop_training = True
            if self.writer.enough():
                self.model.stop_training = True

        def on_train_end(self, logs=None):
            if STATE["enough"]:
                raise EnoughEpochs(0)  # the script's code after fit is not part of what was asked

    _classes[callback_base] = EpochReporter
    return EpochReporter


# --- the public API for training loops gpuctl cannot see into (tf.GradientTape, plain Python) ---


def _run_writer():
    """The run's report writer (the one `fit` uses too), or None off gpuctl."""
    cfg = settings()
    if not cfg.report_path:
        return None
    return ReportWriter.shared(cfg.report_path, cfg.run_id, cfg.usd_per_hour, cfg.budget_usd)


def report_epoch(start=None, end=None, seconds=None, examples=None, planned=None, metrics=None):
    """Report one finished epoch of a custom loop: its `start` and `end` (time.time()), or its
    `seconds` up to now, or neither: the time since the previous report (the first epoch: since
    the script started); `examples` it trained on; `planned` epochs of the whole run; `metrics`
    (a dict of numbers). Off gpuctl it does nothing and returns None; under gpuctl it returns the
    report, and raises EnoughEpochs (the run ends there, exit 0) after the last epoch the run is to
    do (a `gpuctl plan` probe's) or once its budget (`train --budget`) would be crossed."""
    writer = _run_writer()
    if writer is None or STATE["preempted"]:
        return None  # off gpuctl; or cut short by a spot interruption: it runs again, whole
    end = time.time() if end is None else float(end)
    if start is None:
        start = end - float(seconds) if seconds is not None else (writer.last_end or LOADED_AT)
    count = _number(examples)  # numpy and TensorFlow scalars too
    report = writer.write(float(start), end, int(count) if count is not None and count >= 0 else None, False,
                          _positive_int(planned), metrics or {})
    if writer.budget_exhausted(report["epoch_cost_usd"]):
        log("budget of $%.4f reached after $%.4f: ending the run after epoch %d"
             % (writer.budget_usd, writer.cumulative_usd, report["epoch"]))
        raise EnoughEpochs(0)
    if writer.enough():
        raise EnoughEpochs(0)
    return report


class epoch(object):
    """One epoch of a custom loop, timed and reported when the block ends without an error:

        with epoch(examples=len(x_train), planned=EPOCHS) as e:
            for x, y in batches:
                loss = train_step(x, y)
            e.metrics(loss=float(loss))

    A block that raises is no finished epoch: nothing is reported. See report_epoch."""

    def __init__(self, examples=None, planned=None):
        self.examples = examples
        self.planned = planned
        self.values = {}
        self.start = None
        self.report = None

    def metrics(self, **values):
        """Numbers to report with the epoch (loss=..., accuracy=...); later calls add to them."""
        self.values.update(values)

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, etype, value, tb):
        if etype is None:
            self.report = report_epoch(self.start, time.time(), examples=self.examples, planned=self.planned,
                                       metrics=self.values)
        return False


def __getattr__(name):
    """`from gpuctl_report import EpochReporter` gives the reporter for tf.keras (lazy TF import)."""
    if name == "EpochReporter":
        import tensorflow as tf

        return reporter_class(tf.keras.callbacks.Callback)
    raise AttributeError(name)
