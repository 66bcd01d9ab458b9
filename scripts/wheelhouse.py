"""Build a wheelhouse: the wheels of the TensorFlow this checkout's .venv runs (tensorflow-cpu
and its dependencies at the versions installed here, plus tf-keras), for the setup step on test
hosts that have no network (`remote.wheelhouse`). pip fetches them from the index it installed
the venv from (its cache answers for most), with TensorBoard, once: later calls return the same directory.

Usage: .venv/bin/python scripts/wheelhouse.py [DEST]   (default .cache/wheelhouse); prints the path.
"""

from __future__ import annotations

import fcntl
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tensorflow_version() -> str:
    return md.version("tensorflow-cpu")


def build(dest: Path = REPO / ".cache" / "wheelhouse") -> Path:
    version = tensorflow_version()
    target = dest / f"tf-{version}"
    done = target / ".complete"
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions at once build it once
        if done.exists():
            return target
        target.mkdir(exist_ok=True)
        frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                                capture_output=True, text=True, check=True).stdout
        constraints = target / "constraints.txt"
        # The versions installed here, so the wheelhouse holds the same wheels (no "newest" surprises).
        constraints.write_text("".join(line + "\n" for line in frozen.splitlines() if "==" in line))
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", str(target)]
        subprocess.run(pip + ["-c", str(constraints), f"tensorflow-cpu=={version}", "tensorboard"], check=True)
        subprocess.run(pip + ["--no-deps", f"tf-keras=={md.version('tf-keras')}"], check=True)
        done.touch()
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / ".cache" / "wheelhouse"))
