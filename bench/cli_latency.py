"""How fast the CLI answers: `gpuctl --help`, `status` and `cost` against a ledger holding many
runs, side by side with a bare `python -c pass` in the same run. Target: well under a second.

Usage: .venv/bin/python bench/cli_latency.py [--runs 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuctl.state import Ledger  # noqa: E402
from gpuctl.types import ClusterSpec, EpochReport, InstanceRecord, RunRecord  # noqa: E402


def fill(home: Path, runs: int, epochs: int) -> None:
    """A ledger as a busy user's would look: one released cluster with many finished runs."""
    led = Ledger(home)
    led.add_cluster(ClusterSpec(name="bench", provider="local", usd_per_hour=1.0))
    led.put_instance(InstanceRecord(id="i-bench", cluster="bench", state="running", launched_at=0.0,
                                    workdir=str(home / "clusters" / "bench"), usd_per_hour=1.0))
    for r in range(runs):
        rid = f"bench-{r:05d}"
        led.put_run(RunRecord(run_id=rid, cluster="bench", project="/p", entry="train.py", state="succeeded",
                              started_at=float(r), ended_at=float(r) + 100, epochs_planned=epochs,
                              usd_per_hour=1.0, run_dir="/d"))
        led.put_epochs([
            EpochReport.model_validate({
                "schema": 1, "run_id": rid, "epoch": e, "epochs_planned": epochs, "start": 0, "end": 10,
                "seconds": 10, "examples": 50000, "examples_per_s": 5000, "usd_per_hour": 1.0,
                "epoch_cost_usd": 10 / 3600, "cumulative_usd": e * 10 / 3600, "metrics": {"loss": 0.1},
            })
            for e in range(1, epochs + 1)
        ])
    led.mark_cluster_down("bench")


def timed(argv: list[str], env: dict[str, str], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        fill(home, args.runs, args.epochs)
        env = dict(os.environ, GPUCTL_HOME=str(home))
        cli = [sys.executable, "-m", "gpuctl"]
        base, _ = timed([sys.executable, "-c", "pass"], env, args.repeat)
        print(f"ledger: {args.runs} runs x {args.epochs} epochs; median of {args.repeat}; python startup {base*1000:.0f} ms")
        print(f"{'command':<22}{'median ms':>10}{'max ms':>9}{'x python':>10}")
        for label, extra in [("--help", ["--help"]), ("status", ["status"]), ("status --json", ["status", "--json"]),
                             ("cost", ["cost"]), ("cost --json", ["cost", "--json"])]:
            med, worst = timed(cli + extra, env, args.repeat)
            verdict = "ok" if med < 1.0 else "SLOW (target < 1 s)"
            print(f"gpuctl {label:<15}{med*1000:>10.0f}{worst*1000:>9.0f}{med/base:>10.1f}  {verdict}")


if __name__ == "__main__":
    main()
