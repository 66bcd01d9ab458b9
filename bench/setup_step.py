"""How long the setup step takes: a cold install of the pinned TensorFlow into a fresh venv (what
an instance booted from the base image pays once), against the check a second `up`/`train` (or an
instance booted from a baked image) pays, measured side by side in one run.

The install here is tensorflow-cpu from a local wheelhouse (scripts/wheelhouse.py: this checkout's
own wheels, no network), run by the same payload the instance runs, with this machine's python3.
On a g5.xlarge from the base image the install is tensorflow[and-cuda] (~3 GB of wheels from
PyPI): see docs/images.md for the boot-to-ready figures on paper.

Usage: .venv/bin/python bench/setup_step.py [--python python3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import wheelhouse  # noqa: E402

PAYLOAD = REPO / "gpuctl" / "payloads" / "gpuctl_setup.py"


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="python3", help="the instance's system Python")
    args = ap.parse_args()
    wheels = wheelhouse.build()
    version = wheelhouse.tensorflow_version()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        base = [args.python, str(PAYLOAD)]
        common = ["--root", root, "--tensorflow", version]
        cold, res = timed(base + ["install", *common, "--wheelhouse", str(wheels)])
        if res.returncode != 0:
            sys.exit(f"the install failed: {res.stdout}{res.stderr}\n{Path(root, '_envs', f'tf-{version}.log').read_text()[-2000:]}")
        again, _ = timed(base + ["install", *common, "--wheelhouse", str(wheels)])
        probe, out = timed(base + ["probe", *common])
        env = Path(root) / "_envs" / f"tf-{version}"
        size = sum(p.stat().st_size for p in env.rglob("*") if p.is_file() and not p.is_symlink())
        marker = json.loads((env / ".gpuctl-ready").read_text())
    print(f"setup step, tensorflow-cpu {marker['tensorflow']} ({marker['variant']}) from a local wheelhouse, "
          f"Python {marker['python']}:")
    print(f"  cold install (fresh venv, pip, import check): {cold:6.1f} s   venv {size / 1e9:.2f} GB")
    print(f"  install again (env ready: skipped):           {again:6.2f} s")
    print(f"  probe (what up/train ask first):              {probe:6.2f} s")
    print(f"  cold / ready-check ratio:                     {cold / probe:6.0f}x")
    print(f"  wheelhouse: {sum(p.stat().st_size for p in wheels.glob('*.whl')) / 1e6:.0f} MB in {wheels}")


if __name__ == "__main__":
    main()
