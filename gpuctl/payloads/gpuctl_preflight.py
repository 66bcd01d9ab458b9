"""What the instance can do, as one JSON line: Python, TensorFlow and the CUDA/cuDNN it was built
with, the GPUs TensorFlow sees, and nvidia-smi's view. Stdlib + TensorFlow only; Python 3.8+.

Usage: python gpuctl_preflight.py [--cache ROOT] [--recheck]

Importing TensorFlow takes seconds, so with `--cache` the answer is kept per Python executable in
ROOT/_preflight/ and given again while the environment is the same: the same executable, the same
marker of gpuctl's setup step (sys.prefix/.gpuctl-ready), the same TensorFlow files, the same GPUs
and driver in nvidia-smi (which runs every time: it is cheap), the same CUDA_VISIBLE_DEVICES. A
cache that is missing, unreadable, too big or of another shape is ignored and written anew;
`--recheck` ignores it. Only a TensorFlow that imported is kept. Two preflights of one Python
take turns (an flock beside the cache): the one `gpuctl up` starts in the background, and a
`train` that comes before it is done, import TensorFlow once between them.
"""

import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys

CACHE_DIR = "_preflight"  # in the work dir root, beside _envs: no cluster can be named so
CACHE_VERSION = 1
MAX_CACHE = 65536  # bytes: a cache file longer than this is not one of ours
MARKER = ".gpuctl-ready"  # gpuctl_setup.MARKER, in the env's root (sys.prefix of its Python)


def nvidia_smi():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return gpus


def _read(path, limit):
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def fingerprint(gpus):
    """What the cached answer depends on, found without importing TensorFlow."""
    marker = _read(os.path.join(sys.prefix, MARKER), 4096)
    try:
        spec = importlib.util.find_spec("tensorflow")
        origin = spec.origin if spec is not None else None
        st = os.stat(origin) if origin else None
        tf_files = [origin, st.st_mtime_ns, st.st_size] if st else None
    except (ImportError, ValueError, OSError):
        tf_files = None
    return {"executable": sys.executable, "real": os.path.realpath(sys.executable),
            "marker": hashlib.sha1(marker).hexdigest() if marker is not None else None,
            "tensorflow_files": tf_files, "gpus": gpus,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def cache_path(root):
    name = hashlib.sha1(sys.executable.encode("utf-8", "replace")).hexdigest()[:16]
    return os.path.join(os.path.expanduser(root), CACHE_DIR, "%s.json" % name)


def cached(path, key):
    """The kept report if the cache file is whole, ours, and for this very environment; else None."""
    raw = _read(path, MAX_CACHE)
    try:
        data = json.loads(raw.decode("utf-8")) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("fingerprint") != key:
        return None
    report = data.get("report")
    if not isinstance(report, dict) or not isinstance(report.get("tensorflow"), str):
        return None
    return report


def keep(path, key, report):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "w") as fh:
            json.dump({"version": CACHE_VERSION, "fingerprint": key, "report": report}, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next train checks again, nothing worse


def check(gpus):
    """The full look: imports TensorFlow (seconds)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report = {"python": platform.python_version(), "executable": sys.executable, "nvidia_smi": gpus,
              "tensorflow": None, "tf_gpus": [], "cuda": None, "cudnn": None, "error": None}
    try:
        import tensorflow as tf

        report["tensorflow"] = tf.__version__
        report["tf_gpus"] = [d.name for d in tf.config.list_physical_devices("GPU")]
        info = tf.sysconfig.get_build_info()
        report["cuda"] = info.get("cuda_version")
        report["cudnn"] = info.get("cudnn_version")
    except Exception as exc:  # report, do not crash: the CLI decides what to refuse
        report["error"] = "%s: %s" % (type(exc).__name__, exc)
    return report


def taking_turns(path):
    """An open lock file held (flock) until closed, or None where it cannot be made."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fh = open(path + ".lock", "a")
    except OSError:
        return None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
    except OSError:
        fh.close()
        return None
    return fh


def answer(argv):
    """The report for these arguments: kept, or looked for (and kept)."""
    root = argv[argv.index("--cache") + 1] if "--cache" in argv[:-1] else None
    recheck = "--recheck" in argv
    gpus = nvidia_smi()
    if not root:
        return dict(check(gpus), cached=False)
    key, path = fingerprint(gpus), cache_path(root)
    report = None if recheck else cached(path, key)
    if report is None:
        lock = taking_turns(path)
        try:
            report = None if recheck else cached(path, key)  # the one before us may have kept it
            if report is None:
                report = dict(check(gpus), cached=False)
                if report["tensorflow"] and not report["error"]:
                    keep(path, key, report)
                return report
        finally:
            if lock is not None:
                lock.close()
    return dict(report, nvidia_smi=gpus, cached=True)


def main(argv):
    sys.stdout.write(json.dumps(answer(argv)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
