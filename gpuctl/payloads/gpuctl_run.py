"""gpuctl's launcher on the instance: run the user's script; set TensorFlow up and hook Model.fit
once the script imports it.

Usage: python gpuctl_run.py RUN_DIR/run.json [ARGS...]
Stdlib + TensorFlow only, Python 3.8+ (the Deep Learning AMIs ship TF 2.9 to current). The
launcher itself never imports TensorFlow: a script that does not use it starts in milliseconds.
When the script's own `import tensorflow` (or `keras`, `tf_keras`) returns, `tensorflow_imported`
sets the GPU practice and hooks `fit`, so an unmodified Keras script gets per-epoch reports (every
`fit` gets an EpochReporter unless the script passed one itself) and checkpoints.
"""

import functools
import os
import runpy
import sys
import traceback
import types
from typing import Any, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(1, HERE)

import gpuctl_gpu  # noqa: E402  (needs HERE on sys.path)
import gpuctl_imports  # noqa: E402
import gpuctl_report  # noqa: E402
from gpuctl_protocol import (PREEMPTED_EXIT, PREEMPTED_MARK, RUN_DATA_DIR, STOP_FILE, STOPPED_EXIT,  # noqa: E402
                             RunConfig, StoreConfig)

RESTORE_FAILED_EXIT = 3  # a resumed run whose checkpoint could not be brought from the store


class Preempted(gpuctl_report.Stopped):
    """Raised out of the user's script when a spot interruption notice stopped its training."""


def mark_preempted(notice_file, run_dir):
    """Leave the notice beside the run: gpuctl takes exit 75 for a preemption only with it (a
    script may exit 75 for reasons of its own)."""
    try:
        with open(notice_file) as fh:
            notice = fh.read()
    except (OSError, TypeError):
        notice = "{}"
    with open(os.path.join(run_dir, PREEMPTED_MARK), "w") as fh:
        fh.write(notice)


log = gpuctl_report.log


def _keras_flavours(tf):
    """(Model class, Callback class) for each Keras the script might use, without duplicates."""
    pairs = [(tf.keras.Model, tf.keras.callbacks.Callback)]
    mods = ["keras"]
    if os.environ.get("TF_USE_LEGACY_KERAS") or "tf_keras" in sys.modules:
        mods.append("tf_keras")
    for name in mods:
        try:
            mod = __import__(name)
            pairs.append((mod.Model, mod.callbacks.Callback))
        except Exception:
            pass
    seen, out = set(), []
    for model_cls, cb in pairs:
        if model_cls not in seen:
            seen.add(model_cls)
            out.append((model_cls, cb))
    return out


def backup_class(callback_base):
    """Keras's BackupAndRestore from the same Keras as `callback_base` (keras 3, tf_keras)."""
    top = sys.modules.get(callback_base.__module__.split(".")[0])
    return getattr(getattr(top, "callbacks", None), "BackupAndRestore", None)


FITS = {"n": 0}


def whole_epochs_only(backup_cls):
    """BackupAndRestore that keeps the last whole epoch's checkpoint when a stop or a spot
    interruption ends training mid-epoch: Keras still calls on_epoch_end for the partial epoch,
    and saving there would make the resumed run skip the rest of it."""
    if backup_cls is None:
        return None
    if backup_cls not in _WHOLE:
        class Backup(backup_cls):  # type: ignore[valid-type,misc]  # Keras's class, known at run time
            def on_epoch_end(self, epoch, logs=None):
                if gpuctl_report.epoch_cut():
                    return
                super(Backup, self).on_epoch_end(epoch, logs)

        _WHOLE[backup_cls] = Backup
    return _WHOLE[backup_cls]


_WHOLE: Dict[type, type] = {}


class RunStore(object):
    """The run's files (checkpoint, reports, outputs, log) in the cluster's store (S3 on aws), so
    that they outlive the instance; without a store they stay on the host."""

    def __init__(self):
        self.target: Optional[Dict[str, Any]] = None
        self.prefix = self.run_dir = ""
        self.store: Optional[types.ModuleType] = None  # gpuctl_store, once there is a target
        self.read_only = False

    def configure(self, cfg, run_dir):
        store = cfg.store or StoreConfig()
        self.target, self.prefix, self.run_dir = store.target, store.key_prefix, run_dir
        # A multi-node run's other nodes restore the chief's checkpoint; only the chief saves.
        self.read_only = store.read_only
        if self.target:
            import gpuctl_store  # now: the script's directory replaces this one on sys.path later

            self.store = gpuctl_store
        imds = store.imds_endpoint
        if imds and imds.rstrip("/") != "http://169.254.169.254":
            # boto3 reads the instance role's credentials from there (a test's fake IMDS).
            os.environ.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds)

    def save(self, why):
        if not self.target or self.read_only or self.store is None:
            return
        try:
            self.store.push(self.run_dir, self.target, self.prefix, leave_out=(RUN_DATA_DIR,))
        except Exception as exc:  # training goes on: the host still has them
            log("could not save the run's files to the store (%s): %s" % (why, exc))

    def restore(self, checkpoint_dir):
        """On a replacement instance: the checkpoint and the reports, before the script starts."""
        if not self.target or self.store is None or (checkpoint_dir and os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir)):
            return
        import shutil

        tmp = os.path.join(self.run_dir, ".restore")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            got = self.store.pull_when_reachable(self.target, self.prefix, tmp, log)
        except Exception as exc:
            got = {"failed": ["%s: %s" % (type(exc).__name__, exc)]}
        trouble = list(got.get("failed") or []) + ["refused key %s" % k for k in got.get("refused") or []]
        if trouble:
            # Better no run than one that starts over (or from a broken checkpoint) unannounced.
            log("cannot restore the run's checkpoint from the store: %s" % "; ".join(trouble[:5]))
            raise SystemExit(RESTORE_FAILED_EXIT)
        for name in ("outputs", "epochs.jsonl"):
            src, dst = os.path.join(tmp, name), os.path.join(self.run_dir, name)
            if os.path.exists(src):
                shutil.rmtree(dst, ignore_errors=True) if os.path.isdir(dst) else None
                os.replace(src, dst)
        shutil.rmtree(tmp, ignore_errors=True)
        log("restored the run's checkpoint and reports from the store")


STORE = RunStore()


def durable_class(callback_base):
    """A callback that hands the run's files to the store after each epoch (after the checkpoint)."""
    class Durable(callback_base):  # type: ignore[valid-type,misc]  # Keras's base, known at run time
        def on_epoch_end(self, epoch, logs=None):
            if not gpuctl_report.epoch_cut():
                STORE.save("epoch %d" % (epoch + 1))

    return Durable


def with_checkpoint(model, callbacks, checkpoint_dir, backup_cls, callback_base=None):
    """The callbacks with a per-epoch BackupAndRestore added (train --resume restarts from it),
    unless the script has one or the model cannot use one. Added last: the epoch's report is
    written before its checkpoint, so an interruption between the two repeats that epoch rather
    than losing its report."""
    n = FITS["n"]
    FITS["n"] += 1
    if backup_cls is None or any(isinstance(cb, backup_cls) for cb in callbacks):
        return callbacks
    if not getattr(model, "built", True):
        # Keras 3 restores into built models only (keras-team/keras#20712).
        log("no checkpoints for this fit: the model is not built before fit (give it an Input "
            "layer or call model.build(input_shape) first); `gpuctl train --resume` would start it over")
        return callbacks
    directory = os.path.join(checkpoint_dir, "fit-%d" % n)
    if n == 0:
        log("checkpoint after each epoch in %s" % checkpoint_dir)
    added = [whole_epochs_only(backup_cls)(backup_dir=directory, save_freq="epoch", delete_checkpoint=False)]
    if STORE.target and callback_base is not None:
        added.append(durable_class(callback_base)())
    return callbacks + added


def install_fit_hook(tf, checkpoint_dir=None):
    """Wrap Model.fit so that every fit reports each epoch (and checkpoints it, with a
    `checkpoint_dir`); returns how many classes were wrapped."""
    wrapped = 0
    for model_cls, callback_base in _keras_flavours(tf):
        original = model_cls.fit
        if getattr(original, "_gpuctl_wrapped", False):
            continue
        reporter_cls = gpuctl_report.reporter_class(callback_base)
        backup_cls = backup_class(callback_base) if checkpoint_dir else None

        def make(original, reporter_cls, backup_cls, callback_base):
            @functools.wraps(original)
            def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
                callbacks = list(kwargs.get("callbacks") or [])
                reporter = next((cb for cb in callbacks if getattr(cb, "_gpuctl_reporter", False)), None)
                if reporter is None:
                    reporter = reporter_cls()
                    callbacks.append(reporter)
                    kwargs["callbacks"] = callbacks
                if hasattr(reporter, "expect") and reporter.batch_size is None:
                    n, bs = gpuctl_report.count_examples(
                        x, batch_size, kwargs.get("validation_split") or 0.0, kwargs.get("steps_per_epoch")
                    )
                    reporter.expect(n, bs)
                if checkpoint_dir:
                    kwargs["callbacks"] = with_checkpoint(self, list(kwargs.get("callbacks") or []), checkpoint_dir,
                                                          backup_cls, callback_base)
                gpuctl_report.STATE["in_fit"] = True
                reassert_sigterm()
                try:
                    history = original(self, x, y, batch_size, *args, **kwargs)
                except Exception as exc:
                    if not gpuctl_report.STATE["stop_requested"]:
                        raise
                    # Several nodes: this one left at its batch end, its peers went on, and the
                    # next collective failed between them. The stop is why, not the error.
                    log("training stopped on the %s (%s from the other workers)"
                        % ("notice" if gpuctl_report.STATE["preempted"] else "stop", type(exc).__name__))
                    raise stopped() from None
                finally:
                    gpuctl_report.STATE["in_fit"] = False
                if gpuctl_report.STATE["stop_requested"]:
                    # Not the script's code after fit: its model is mid-training (saved as its
                    # final one, it would pass for a finished run), and a preempted instance has
                    # two minutes left. The checkpoint of the last whole epoch is on disk.
                    raise stopped()
                return history

            fit._gpuctl_wrapped = True  # type: ignore[attr-defined]  # marks the wrapper (not wrapped twice)
            return fit

        model_cls.fit = make(original, reporter_cls, backup_cls, callback_base)
        wrapped += 1
    return wrapped


def stopped():
    """What ends the script once training stopped: Preempted (75) on a notice, else Stopped (143)."""
    return Preempted(PREEMPTED_EXIT) if gpuctl_report.STATE["preempted"] else gpuctl_report.Stopped(STOPPED_EXIT)


def install_sigterm(notice_file=None):
    """SIGTERM (gpuctl stop, down, a guard's budget) ends training at the next batch end, not
    mid-step, and the script right after `fit` (gpuctl_report.Stopped out of it: its code after
    fit does not run, its `finally` does); an epoch it cut short is neither reported nor
    checkpointed. A second SIGTERM, or one outside `fit`, exits at once. A SIGTERM after the
    watchdog heard a spot interruption notice (`notice_file`) ends it the same way, as preempted."""
    import signal

    def on_term(signum, frame):
        preempted = bool(notice_file) and os.path.exists(notice_file)
        if preempted:
            gpuctl_report.STATE["preempted"] = True
        if gpuctl_report.STATE["in_fit"] and not gpuctl_report.STATE["stop_requested"]:
            gpuctl_report.STATE["stop_requested"] = True
            log("%s: stopping training after this batch; the run resumes from the last whole epoch"
                % ("spot interruption notice" if preempted else "SIGTERM"))
            return
        if preempted and gpuctl_report.STATE["stop_requested"]:
            return  # a second word of the same notice (a restarted watchdog): the stop is under way
        raise Preempted(PREEMPTED_EXIT) if preempted else gpuctl_report.Stopped(STOPPED_EXIT)

    _SIGTERM["handler"] = on_term
    signal.signal(signal.SIGTERM, on_term)


_SIGTERM: Dict[str, Any] = {"handler": None}


def reassert_sigterm():
    """Put gpuctl's SIGTERM handler back: MultiWorkerMirroredStrategy's coordination service
    installs TensorFlow's own (C-level: it only records the signal), after the launcher's, and a
    spot notice or `gpuctl down` would then go unheard until the SIGKILL. A handler the script set
    itself (Python knows of it) is left alone."""
    import signal

    if _SIGTERM["handler"] is None or signal.getsignal(signal.SIGTERM) is not _SIGTERM["handler"]:
        return
    try:
        signal.signal(signal.SIGTERM, _SIGTERM["handler"])
    except ValueError:
        pass  # fit called outside the main thread: signals reach the main thread only anyway


# The modules whose import means "the script uses TensorFlow" (Keras 3 imports it, as does tf_keras).
TF_MODULES = ("tensorflow", "keras", "tf_keras")
_TF_READY = {"gpus": False, "busy": False}


def tensorflow_imported(cfg):
    """The one place where "the script imported TensorFlow" turns into gpuctl's set-up: the GPU
    practice (once, before the script's first op) and the fit hook (for each Keras imported by
    now; a Keras imported later is hooked when its import returns). Runs after the outermost
    import of TF_MODULES; a failure here is the launcher's, never the script's: it is logged and
    the script trains without reports."""
    tf = sys.modules.get("tensorflow")
    # `busy`: touching tf.keras imports a Keras, whose import returning calls this again.
    if tf is None or not hasattr(tf, "config") or _TF_READY["busy"]:
        return  # (no tf.config: a Keras on another backend, nothing of TensorFlow's to set)
    _TF_READY["busy"] = True
    try:
        if not _TF_READY["gpus"]:
            _TF_READY["gpus"] = True
            gpuctl_gpu.configure_tensorflow(tf, log, cfg.mixed_precision, cfg.memory_growth)
        install_fit_hook(tf, cfg.checkpoint_dir)
    except Exception as exc:
        log("could not hook TensorFlow for per-epoch reports (%s: %s); training goes on without them"
            % (type(exc).__name__, exc))
    finally:
        _TF_READY["busy"] = False


def watch_tensorflow(cfg):
    """Call `tensorflow_imported(cfg)` whenever the script's import of TensorFlow or a Keras returns."""
    return gpuctl_imports.ImportWatch(TF_MODULES, lambda: tensorflow_imported(cfg)).install()


def main(argv):
    if not argv:
        sys.stderr.write("usage: gpuctl_run.py RUN_DIR/run.json [ARGS...]\n")
        return 2
    cfg = RunConfig.load(argv[0])
    entry = cfg.entry
    if not entry:
        sys.stderr.write("gpuctl_run.py: no entry in %s\n" % argv[0])
        return 2
    # TensorFlow's C++ INFO lines drown the training output; warnings and errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    STORE.configure(cfg, os.path.dirname(os.path.abspath(argv[0])))
    if cfg.resumed:
        STORE.restore(cfg.checkpoint_dir)
    gpuctl_report.STATE["resumed"] = cfg.resumed
    watch_tensorflow(cfg)
    install_sigterm(cfg.notice_file)
    if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(argv[0])), STOP_FILE)):
        log("stopped before the script started")  # its SIGTERM came before the handler above
        return STOPPED_EXIT
    # Run the entry exactly as `python ENTRY ARGS...` would: its directory first on sys.path.
    sys.argv = [entry] + list(argv[1:])
    sys.path[0] = os.path.dirname(os.path.abspath(entry))
    try:
        runpy.run_path(entry, run_name="__main__")
    except Preempted:
        log("preempted: the last whole epoch's checkpoint is kept%s" % (" in the store" if STORE.target else ""))
        mark_preempted(cfg.notice_file, os.path.dirname(os.path.abspath(argv[0])))
        STORE.save("preempted")
        return PREEMPTED_EXIT
    except gpuctl_report.Stopped:
        log("stopped%s%s" % (
            " at a batch end: the script's code after fit did not run" if gpuctl_report.STATE["stop_requested"] else "",
            "; `gpuctl train --resume %s` continues from the last whole epoch's checkpoint" % cfg.run_id
            if cfg.checkpoint_dir and os.path.isdir(cfg.checkpoint_dir) and os.listdir(cfg.checkpoint_dir) else ""))
        STORE.save("stopped")
        return STOPPED_EXIT
    except Exception:
        # Show the script's traceback as `python ENTRY` would: without the launcher's frames.
        etype, value, tb = sys.exc_info()
        while tb is not None and (tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"):
            tb = tb.tb_next
        traceback.print_exception(etype, value, tb)
        return 1
    STORE.save("the end")
    # Stopped by SIGTERM, and the script caught gpuctl_report.Stopped: the run did not complete.
    return STOPPED_EXIT if gpuctl_report.STATE["stop_requested"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
