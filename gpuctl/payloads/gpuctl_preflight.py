"""What the instance can do, as one JSON line: Python, TensorFlow and the CUDA/cuDNN it was built
with, the GPUs TensorFlow sees, and nvidia-smi's view. Stdlib + TensorFlow only; Python 3.8+."""

import json
import os
import platform
import subprocess
import sys


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


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report = {"python": platform.python_version(), "executable": sys.executable, "nvidia_smi": nvidia_smi(),
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
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
