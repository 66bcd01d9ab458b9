"""How fast the CLI answers: `gpuctl --help`, `status` and `cost` against a ledger holding many runs,
each as a ratio to a bare `python -c pass` and to `gpuctl --help` measured in the same run, with
each command's CPU time and peak memory (the child's, from wait4). Targets: `--help` within 0.10 s;
at 1,000 runs x 20 epochs (issue 39) `status` 150 ms, `cost` 200 ms, `cost --json` 250 ms, every
report under 100 MB, growing linearly with the runs.

The `floor` rows are the stack every report stands on, timed in the same rounds: the interpreter
loading pydantic and validating one model, then click too, then rich printing one line. No report
can be faster than its floor; the ratio of a target to the floor says how much room it leaves.

The commands are timed round-robin (one of each, N times), so a busy machine slows them all alike
and the ratios stay comparable; each figure is the median of its N runs. Bytecode is cached in a
temporary PYTHONPYCACHEPREFIX after one untimed round, as an installed package has its .pyc files,
even where PYTHONDONTWRITEBYTECODE is set (compiling gpuctl's sources costs ~10 ms a run).

With `--against DIR` (another gpuctl's source tree, e.g. `git worktree add /tmp/base <commit>`)
each gpuctl command is also timed from that tree, in the same rounds, on its own copy of the
ledger: a change's figures side by side with the ones before it. Both trees then run as
`python -m gpuctl` with PYTHONPATH at the tree.

`--home DIR` keeps the ledger there (filled when DIR is empty, reused as it is otherwise), so
two trees' outputs can be compared on the same ledger; `--outputs DIR` writes each report's stdout
(from the untimed first round) there, one file per command.

Usage: .venv/bin/python bench/cli_latency.py [--runs 1000] [--epochs 20] [--repeat 15] [--against DIR]
       [--home DIR] [--outputs DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuctl.ledger import Ledger  # noqa: E402
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord  # noqa: E402
from gpuctl.model.specs import LocalSpec  # noqa: E402

HELP_TARGET_S = 0.10
REPORT_TARGET_S = 1.0
# Issue 39's targets at 1,000 runs x 20 epochs (REPORT_TARGET_S for the rest), growing linearly with the runs.
TARGETS_AT_1000_S = {"status": 0.150, "cost": 0.200, "cost --json": 0.250}
MEMORY_TARGET_MB = 100.0

_MODEL = "from pydantic import BaseModel\nclass A(BaseModel):\n    x: int\nA.model_validate_json('{\"x\": 1}')\n"
_RICH = "from rich.console import Console\nfrom rich.text import Text\nConsole().print(Text('x'))\n"
FLOORS = {
    "floor pydantic + 1 model": _MODEL,
    "floor + click": "import click\n" + _MODEL,
    "floor + click + rich": "import click\n" + _MODEL + _RICH,
}


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
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--against", type=Path, help="another gpuctl source tree, timed side by side")
    ap.add_argument("--home", type=Path, help="keep the ledger here (filled if empty, else reused)")
    ap.add_argument("--outputs", type=Path, help="write each report's stdout here (one file per command)")
    args = ap.parse_args()
    if args.against is not None and not (args.against / "gpuctl" / "__main__.py").is_file():
        ap.error(f"--against {args.against}: no gpuctl source tree there (gpuctl/__main__.py)")
    here = Path(__file__).resolve().parent.parent
    trees = {"": here} if args.against is None else {"": here, "before: ": args.against.resolve()}
    subcommands = [["--help"], ["status"], ["status", "--json"], ["cost"], ["cost", "--json"]]
    commands: dict[str, tuple[list[str], str]] = {"python -c pass": ([sys.executable, "-c", "pass"], "")}
    # The floor of the stack a report stands on, before it reads one row: what the interpreter
    # takes to load pydantic and validate one model, then click, then rich and print one line.
    for label, code in FLOORS.items():
        commands[label] = ([sys.executable, "-c", code], "")
    for prefix in trees:
        cli = gpuctl_argv() if args.against is None else [sys.executable, "-m", "gpuctl"]
        for sub in subcommands:
            commands[f"{prefix}gpuctl {' '.join(sub)}"] = (cli + sub, prefix)
    with tempfile.TemporaryDirectory() as tmp:
        envs: dict[str, dict[str, str]] = {}
        for prefix, tree in trees.items():
            home = Path(tmp) / (prefix.strip(": ") or "this")
            if not envs:
                if args.home is not None:
                    args.home.mkdir(parents=True, exist_ok=True)
                    if not any(args.home.iterdir()):
                        fill(args.home, args.runs, args.epochs)
                    shutil.copytree(args.home, home)
                else:
                    fill(home, args.runs, args.epochs)
            else:  # the same ledger, its own copy (a report must not read the other's writes)
                shutil.copytree(Path(tmp) / "this", home)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env.update(GPUCTL_HOME=str(home), GPUCTL_PROVIDER="local", PYTHONPYCACHEPREFIX=str(Path(tmp) / "pycache"))
            if args.against is not None:
                env["PYTHONPATH"] = str(tree)
            envs[prefix] = env
        times: dict[str, list[float]] = {label: [] for label in commands}
        cpus: dict[str, list[float]] = {label: [] for label in commands}
        peaks: dict[str, float] = {label: 0.0 for label in commands}
        for n in range(args.repeat + 1):
            for label, (argv, prefix) in commands.items():
                out, wall, cpu, peak = run_once(argv, envs[prefix])
                if n:  # round 0 writes the bytecode
                    times[label].append(wall)
                    cpus[label].append(cpu)
                    peaks[label] = max(peaks[label], peak)
                elif args.outputs is not None and label.split(": ", 1)[-1].startswith("gpuctl "):
                    args.outputs.mkdir(parents=True, exist_ok=True)
                    name = (prefix.strip(": ") + "-" if prefix else "") + label.split(": ", 1)[-1][7:]
                    (args.outputs / (name.replace(" ", "_").replace("-", "") or "x")).write_bytes(out)
    base = statistics.median(times["python -c pass"])
    print(f"ledger: {args.runs} runs x {args.epochs} epochs; median of {args.repeat} runs each, round-robin; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'command':<32}{'wall ms':>8}{'max ms':>8}{'CPU ms':>8}{'x python':>10}{'x --help':>10}"
          f"{'CPU x --help':>14}{'peak MB':>9}")
    for label, ts in times.items():
        med = statistics.median(ts)
        cpu = statistics.median(cpus[label])
        prefix, name = label.split(": ", 1) if ": " in label else ("", label)
        help_label = f"{prefix + ': ' if prefix else ''}gpuctl --help"
        helped, help_cpu = statistics.median(times[help_label]), statistics.median(cpus[help_label])
        sub = name[len("gpuctl "):]
        target = (HELP_TARGET_S if sub == "--help"
                  else TARGETS_AT_1000_S.get(sub, REPORT_TARGET_S) * max(args.runs, 1000) / 1000
                  if name.startswith("gpuctl") else None)
        peak = peaks[label]
        verdict = [] if target is None else ["ok" if med <= target else f"SLOW (target {target * 1000:.0f} ms)"]
        if target is not None and peak > MEMORY_TARGET_MB:
            verdict.append(f"BIG (target {MEMORY_TARGET_MB:.0f} MB)")
        print(f"{label:<32}{med * 1000:>8.0f}{max(ts) * 1000:>8.0f}{cpu * 1000:>8.0f}{med / base:>9.2f}x"
              f"{med / helped:>9.2f}x{cpu / help_cpu:>13.2f}x{peak:>9.1f}  {' '.join(verdict)}")


def run_once(argv: list[str], env: dict[str, str]) -> tuple[bytes, float, float, float]:
    """(stdout, wall seconds, CPU seconds (user + system), peak RSS in MB) of one run of the
    command, started by a bare launcher (see _LAUNCHER); its exit status must be 0. It runs in its
    ledger's home: `python -m` puts the cwd first on sys.path, and run from a gpuctl checkout
    every tree was that one."""
    with tempfile.TemporaryFile() as figures:
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(figures.fileno()), *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True,
                              cwd=env["GPUCTL_HOME"], pass_fds=(figures.fileno(),))
        figures.seek(0)
        wall, cpu, maxrss = figures.read().split()
    return proc.stdout, float(wall), float(cpu), int(maxrss) / 1024.0  # ru_maxrss is in kB on Linux


# Each command is forked from a bare `python -S`, which times it (its own start-up not counted)
# and reports its wait4 figures. Linux counts the pages a process had before exec in its maximum
# RSS, and a child of this process (which holds gpuctl and a filled ledger's objects) would start
# with all of them. CPU time says what wall time on a busy machine cannot: the command's own work.
_LAUNCHER = """import os, sys, time
fd = int(sys.argv[1])
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - t0
os.write(fd, f"{wall} {usage.ru_utime + usage.ru_stime} {usage.ru_maxrss}".encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


if __name__ == "__main__":
    main()
