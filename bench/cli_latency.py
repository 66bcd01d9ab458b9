"""How fast the CLI answers: `gpuctl --help`, `status` and `cost` against a ledger holding many runs,
each as a ratio to a bare `python -c pass` measured in the same run. Targets: `--help` within
0.10 s, reports well under a second.

The commands are timed round-robin (one of each, N times), so a busy machine slows them all alike
and the ratios stay comparable; each figure is the median of its N runs. Bytecode is cached in a
temporary PYTHONPYCACHEPREFIX after one untimed round, as an installed package has its .pyc files,
even where PYTHONDONTWRITEBYTECODE is set (compiling gpuctl's sources costs ~10 ms a run).

Usage: .venv/bin/python bench/cli_latency.py [--runs 200] [--epochs 20] [--repeat 15]
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

from gpuctl.ledger import Ledger  # noqa: E402
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord  # noqa: E402
from gpuctl.model.specs import LocalSpec  # noqa: E402

HELP_TARGET_S = 0.10
REPORT_TARGET_S = 1.0


def fill(home: Path, runs: int, epochs: int) -> None:
    """A ledger as a busy user's would look: one released cluster with many finished runs."""
    led = Ledger(home)
    cluster = led.add_cluster(LocalSpec(name="bench", usd_per_hour=1.0))
    led.put_instance(cluster.id, InstanceRecord(id="i-bench", cluster="bench", state="running", launched_at=0.0,
                                                workdir=str(home / "clusters" / "bench"), usd_per_hour=1.0))
    for r in range(runs):
        rid = f"bench-{r:05d}"
        led.put_run(RunRecord(run_id=rid, cluster="bench", cluster_id=cluster.id, project="/p", entry="train.py",
                              state="succeeded", started_at=float(r), ended_at=float(r) + 100,
                              epochs_planned=epochs, usd_per_hour=1.0, run_dir="/d"))
        led.put_epochs([
            EpochReport.model_validate({
                "schema": 1, "run_id": rid, "epoch": e, "epochs_planned": epochs, "start": 0, "end": 10,
                "seconds": 10, "examples": 50000, "examples_per_s": 5000, "usd_per_hour": 1.0,
                "epoch_cost_usd": 10 / 3600, "cumulative_usd": e * 10 / 3600, "metrics": {"loss": 0.1},
            })
            for e in range(1, epochs + 1)
        ])
    led.mark_cluster_down(cluster.id)
    led.close()


def gpuctl_argv() -> list[str]:
    """The console script users run, next to this interpreter; else `python -m gpuctl`."""
    script = Path(sys.executable).with_name("gpuctl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuctl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    cli = gpuctl_argv()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "gpuctl --help": cli + ["--help"],
        "gpuctl status": cli + ["status"],
        "gpuctl status --json": cli + ["status", "--json"],
        "gpuctl cost": cli + ["cost"],
        "gpuctl cost --json": cli + ["cost", "--json"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        fill(home, args.runs, args.epochs)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(GPUCTL_HOME=str(home), GPUCTL_PROVIDER="local", PYTHONPYCACHEPREFIX=str(home / "pycache"))
        times: dict[str, list[float]] = {label: [] for label in commands}
        for n in range(args.repeat + 1):
            for label, argv in commands.items():
                t0 = time.perf_counter()
                subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
                if n:  # round 0 writes the bytecode
                    times[label].append(time.perf_counter() - t0)
    base = statistics.median(times["python -c pass"])
    print(f"ledger: {args.runs} runs x {args.epochs} epochs; median of {args.repeat} runs each, round-robin")
    print(f"{'command':<24}{'median ms':>10}{'max ms':>8}{'x python':>10}")
    for label, ts in times.items():
        med = statistics.median(ts)
        target = HELP_TARGET_S if label.endswith("--help") else REPORT_TARGET_S if label.startswith("gpuctl") else None
        verdict = "" if target is None else ("ok" if med <= target else f"SLOW (target {target * 1000:.0f} ms)")
        print(f"{label:<24}{med * 1000:>10.0f}{max(ts) * 1000:>8.0f}{med / base:>9.2f}x  {verdict}")


if __name__ == "__main__":
    main()
