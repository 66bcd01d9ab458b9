"""The run's GPUs: TensorFlow's settings for them, once the script imports it, and their utilisation
and memory, sampled from nvidia-smi while it trains. Stdlib only (TensorFlow is handed in); Python 3.8+.

A daemon thread asks nvidia-smi every `interval_s` for the run's GPUs (CUDA_VISIBLE_DEVICES, as
the cluster's queue set it) and keeps the samples; an epoch's report takes the mean utilisation
and the peak memory of the samples taken during it. Where there is no nvidia-smi (a CPU host),
the first failed call ends the thread and every report says nothing about the GPU (n/a).
"""

import collections
import math
import os
import subprocess
import threading
import time
from typing import Any, Deque, Dict, Tuple

QUERY = "--query-gpu=utilization.gpu,memory.used,memory.total"
CALL_TIMEOUT_S = 10.0
MAX_SAMPLES = 20000  # a day at 5 s; older ones are dropped (an epoch longer than that gets the newest)
MAX_GPUS = 64
MAX_MIB = 10.0 ** 7  # 10 TB of GPU memory on one machine: anything above is not a reading


def _number(text, low, high):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and low <= value <= high else None


def parse(text):
    """(mean utilisation %, memory used MiB, memory total MiB) of nvidia-smi's CSV lines, summed
    over the GPUs for memory; None when no line is a reading."""
    utils, used, total = [], 0.0, 0.0
    for line in (text or "").splitlines()[:MAX_GPUS]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        u, m, t = _number(parts[0], 0, 100), _number(parts[1], 0, MAX_MIB), _number(parts[2], 0, MAX_MIB)
        if u is None or m is None or t is None:
            continue
        utils.append(u)
        used += m
        total += t
    if not utils:
        return None
    return sum(utils) / len(utils), used, total


def visible_gpus():
    """The `-i` list for nvidia-smi from CUDA_VISIBLE_DEVICES (indexes only), or None for all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return ",".join(ids) if ids and all(v.isdigit() for v in ids) else None


class Sampler(object):
    """Samples in a daemon thread until nvidia-smi fails (or is missing)."""

    def __init__(self, interval_s, command=None):
        self.interval_s = max(0.05, float(interval_s))
        self.command = command or ["nvidia-smi", QUERY, "--format=csv,noheader,nounits"]
        gpus = visible_gpus()
        if gpus and command is None:
            self.command = self.command + ["-i", gpus]
        self.samples: Deque[Tuple[float, ...]] = collections.deque(maxlen=MAX_SAMPLES)  # (time, util, used, total)
        self.failed = False
        self._thread = None

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpuctl-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def sample(self):
        """One reading now, kept; None (and the sampler stops) where nvidia-smi does not answer."""
        try:
            res = subprocess.run(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 timeout=CALL_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            self.failed = True
            return None
        reading = parse(res.stdout[:65536].decode("utf-8", "replace")) if res.returncode == 0 else None
        if reading is None:
            self.failed = True
            return None
        self.samples.append((time.time(),) + reading)
        return reading

    def _loop(self):
        while not self.failed:
            self.sample()
            time.sleep(self.interval_s)

    def between(self, start, end):
        """What an epoch from `start` to `end` gets: {} when no sample fell in it."""
        inside = [s for s in list(self.samples) if start <= s[0] <= end]
        if not inside:
            return {}
        return {
            "gpu_util_percent": sum(s[1] for s in inside) / len(inside),
            "gpu_memory_used_mib": max(s[2] for s in inside),
            "gpu_memory_total_mib": max(s[3] for s in inside),
            "gpu_samples": len(inside),
        }


_SAMPLER = {"it": None}


def sampler(interval_s):
    """The process's one sampler, started on first use; None when sampling is off (0)."""
    try:
        interval = float(interval_s)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(interval) and interval > 0):
        return None
    if _SAMPLER["it"] is None:
        _SAMPLER["it"] = Sampler(interval).start()
    return _SAMPLER["it"]


def want_mixed_precision(setting, capabilities):
    """mixed_float16 only pays on GPUs with tensor cores (compute capability 7.0+); never on a CPU.

    `capabilities` holds one (major, minor) or None per visible GPU; every GPU must qualify.
    """
    if not capabilities or setting == "off":
        return False
    if setting == "on":
        return True
    return all(cc is not None and tuple(cc) >= (7, 0) for cc in capabilities)


def configure_tensorflow(tf, log, mixed_precision="auto", memory_growth=True):
    """The seed articles' GPU practice: memory growth on; mixed_float16 on compute capability >= 7.0.
    `log` writes gpuctl's lines to the run's log (the launcher's)."""
    gpus = tf.config.list_physical_devices("GPU")
    info: Dict[str, Any] = {"gpus": [], "mixed_precision": False}
    for gpu in gpus:
        if memory_growth:
            tf.config.experimental.set_memory_growth(gpu, True)
        try:
            details = tf.config.experimental.get_device_details(gpu)
        except Exception:
            details = {}
        cc = details.get("compute_capability")
        info["gpus"].append({"name": details.get("device_name", gpu.name), "compute_capability": cc})
    if want_mixed_precision(mixed_precision, [g["compute_capability"] for g in info["gpus"]]):
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        info["mixed_precision"] = True
    if gpus:
        log("GPUs: %s; memory growth %s; mixed precision %s" % (
            ", ".join("%s (cc %s)" % (g["name"], g["compute_capability"]) for g in info["gpus"]),
            "on" if memory_growth else "off",
            "on" if info["mixed_precision"] else "off",
        ))
    else:
        log("no GPU visible to TensorFlow %s: training on the CPU" % tf.__version__)
    return info
