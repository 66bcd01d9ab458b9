"""Examples/s of one node against two, side by side in one run, with the unmodified
MultiWorkerMirroredStrategy script of examples/multiworker on the `local` provider (N workers on
this machine: the same host class for both, by construction).

Read the figures for what they are: local workers share this machine's cores, so two nodes here
split the same CPUs and add the all-reduce between them; no speed-up is expected, and the figure
that matters is how much the second node's coordination costs. docs/multinode.md gives the scaling
to expect on g5 nodes, on paper.

Usage: .venv/bin/python bench/multinode.py [--epochs 4] [--batch-size 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPUCTL = [sys.executable, "-m", "gpuctl"]


def gpuctl(env: dict[str, str], *args: str) -> str:
    res = subprocess.run([*GPUCTL, *args], env=env, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"gpuctl {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res.stdout


def measure(nodes: int, epochs: int, batch: int) -> dict[str, float]:
    """One cluster of `nodes` local workers, one run; examples/s of its epochs after the first
    (the first holds TensorFlow's graph building)."""
    with tempfile.TemporaryDirectory(prefix="gpuctl-bench-") as home:
        env = {**os.environ, "GPUCTL_HOME": home, "GPUCTL_PROVIDER": "local", "TF_CPP_MIN_LOG_LEVEL": "2"}
        gpuctl(env, "up", "--nodes", str(nodes), "--name", f"bench{nodes}")
        try:
            gpuctl(env, "train", str(REPO / "examples" / "multiworker"), "--wait", "--",
                   "--epochs", str(epochs), "--batch-size", str(batch))
            run = json.loads(gpuctl(env, "cost", "--json"))["runs"][0]
        finally:
            gpuctl(env, "down", "-y")
    rates = [e["examples_per_s"] for e in run["epochs"][1:] if e.get("examples_per_s")]
    secs = [e["seconds"] for e in run["epochs"][1:]]
    return {"examples_per_s": statistics.median(rates), "epoch_s": statistics.median(secs),
            "examples": run["epochs"][-1]["examples"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64, help="per worker (the global batch grows with nodes)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate 1 and 2 nodes this many times")
    args = ap.parse_args()
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for _ in range(args.repeat):
        for n in (1, 2):  # side by side, alternating: the machine's state drifts for both alike
            results[n].append(measure(n, args.epochs, args.batch_size))
    print(f"examples/multiworker, {args.epochs} epochs (median of epochs 2..), batch {args.batch_size} per worker, "
          f"{os.cpu_count()} CPU cores shared by every local node")
    print(f"{'nodes':>5}  {'examples/s':>10}  {'per node':>9}  {'epoch s':>8}  {'examples/epoch':>14}")
    base = statistics.median(r["examples_per_s"] for r in results[1])
    for n, rows in results.items():
        rate = statistics.median(r["examples_per_s"] for r in rows)
        print(f"{n:>5}  {rate:>10.0f}  {rate / n:>9.0f}  {statistics.median(r['epoch_s'] for r in rows):>8.2f}  "
              f"{rows[0]['examples']:>14.0f}")
    two = statistics.median(r["examples_per_s"] for r in results[2])
    print(f"2 nodes / 1 node: {two / base:.2f}x (on one machine's shared cores no speed-up is expected)")


if __name__ == "__main__":
    main()
