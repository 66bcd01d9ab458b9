"""How fast the CLI answers: `gpuctl --help`, `status` and `cost` against a ledger holding many runs,
each as a ratio to a bare `python -c pass` measured in the same run. Targets: `--help` within
0.10 s, reports well under a second.

The commands are timed round-robin (one of each, N times), so a busy machine slows them all alike
and the ratios stay comparable; each figure is the median of its N runs. Bytecode is cached in a
temporary PYTHONPYCACHEPREFIX after one untimed round, as an installed package has its .pyc files,
even where PYTHONDONTWRITEBYTECODE is set (compiling gpuctl's sources costs ~10 ms a run).

With `--against DIR` (another gpuctl's source tree, e.g. `git worktree add /tmp/base <commit>`)
each gpuctl command is also timed from that tree, in the same rounds, on its own copy of the
ledger: a change's figures side by side with the ones before it. Both trees then run as
`python -m gpuctl` with PYTHONPATH at the tree.

Usage: .venv/bin/python bench/cli_latency.py [--runs 200] [--epochs 20] [--repeat 15] [--against DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    ap.add_argument("--against", type=Path, help="another gpuctl source tree, timed side by side")
    args = ap.parse_args()
    if args.against is not None and not (args.against / "gpuctl" / "__main__.py").is_file():
        ap.error(f"--against {args.against}: no gpuctl source tree there (gpuctl/__main__.py)")
    here = Path(__file__).resolve().parent.parent
    trees = {"": here} if args.against is None else {"": here, "before: ": args.against.resolve()}
    subcommands = [["--help"], ["status"], ["status", "--json"], ["cost"], ["cost", "--json"]]
    commands: dict[str, tuple[list[str], str]] = {"python -c pass": ([sys.executable, "-c", "pass"], "")}
    for prefix in trees:
        cli = gpuctl_argv() if args.against is None else [sys.executable, "-m", "gpuctl"]
        for sub in subcommands:
            commands[f"{prefix}gpuctl {' '.join(sub)}"] = (cli + sub, prefix)
    with tempfile.TemporaryDirectory() as tmp:
        envs: dict[str, dict[str, str]] = {}
        for prefix, tree in trees.items():
            home = Path(tmp) / (prefix.strip(": ") or "this")
            if not envs:
                fill(home, args.runs, args.epochs)
            else:  # the same ledger, its own copy (a report must not read the other's writes)
                shutil.copytree(Path(tmp) / "this", home)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env.update(GPUCTL_HOME=str(home), GPUCTL_PROVIDER="local", PYTHONPYCACHEPREFIX=str(home / "pycache"))
            if args.against is not None:
                env["PYTHONPATH"] = str(tree)
            envs[prefix] = env
        times: dict[str, list[float]] = {label: [] for label in commands}
        for n in range(args.repeat + 1):
            for label, (argv, prefix) in commands.items():
                t0 = time.perf_counter()
                subprocess.run(argv, env=envs[prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               check=True)
                if n:  # round 0 writes the bytecode
                    times[label].append(time.perf_counter() - t0)
    base = statistics.median(times["python -c pass"])
    print(f"ledger: {args.runs} runs x {args.epochs} epochs; median of {args.repeat} runs each, round-robin")
    print(f"{'command':<32}{'median ms':>10}{'max ms':>8}{'x python':>10}")
    for label, ts in times.items():
        med = statistics.median(ts)
        name = label.split(": ", 1)[-1]
        target = HELP_TARGET_S if name.endswith("--help") else REPORT_TARGET_S if name.startswith("gpuctl") else None
        verdict = "" if target is None else ("ok" if med <= target else f"SLOW (target {target * 1000:.0f} ms)")
        print(f"{label:<32}{med * 1000:>10.0f}{max(ts) * 1000:>8.0f}{med / base:>9.2f}x  {verdict}")


if __name__ == "__main__":
    main()
