"""Memory for what an instance sends back: the peak RSS of one gpuctl command
against the size of the hostile input it reads. Target: flat, well under 100 MB in every case.

Cases, each made on the local provider (this machine plays the instance: the files are planted
where the instance keeps them) in a gpuctl home of its own:
- logs:     `gpuctl logs RUN` of a run whose output.log is SIZE bytes (lines of 100 characters)
- status:   `gpuctl status` of a failed run with such a log (its last lines are shown)
- sync:     `gpuctl sync PROJECT` when the push manifest on the instance is a zlib bomb
- preflight: the preflight of a host whose Python prints SIZE bytes before its answer (the local
            provider runs no preflight: the client's preflight call is made on a LocalHost)
- epochs:   `gpuctl status`, twice, of a run whose epochs.jsonl is SIZE bytes of report lines
- sparse:   `gpuctl status`, twice, of a live run whose epochs.jsonl is a hole of SIZE bytes
            (truncate) and a report line after it (its seconds show what a look scans)
- output:   a command's output: the GPU count (ops/queue.py) on a host whose nvidia-smi -L prints
            SIZE bytes (a fake on PATH), on this machine as the instance (local) and, where this
            machine can start the sshd test hosts (root: tests/sshd.py), over SSH (ssh)

Each command runs in a child process; its peak RSS comes from wait4(). --baseline DIR runs every
case a second time with the gpuctl of DIR (an older checkout: `git archive COMMIT | tar -x -C DIR`)
and prints the two side by side.

Usage: .venv/bin/python bench/untrusted_memory.py [--full] [--baseline DIR] [--only logs,status,...]
       (default sizes are a tenth of --full's: 400 MB logs, a 3 GB bomb, 300 MB of
       preflight output, a 228 MB epochs.jsonl, a 1 GB hole, 1 GB of command output, as the
       audit measured them)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
MB = 1 << 20

QUICK = '''
import sys, time
import gpuctl_report
cfg = gpuctl_report.run_config()
w = gpuctl_report.ReportWriter.shared(cfg["report_path"], cfg["run_id"], cfg["usd_per_hour"])
w.write(time.time() - 1, time.time(), 100, False, 2, {"loss": 0.5})
print("done", flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
'''


def peak_mb(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int, float]:
    """(peak RSS in MB, exit code, seconds) of one command, its output thrown away."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # stderr is small (an error, notes): read it after the exit, through a file, not a pipe that could fill.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
    if proc.returncode not in (0, 7):
        print(f"    ({' '.join(argv[-3:])} exited {proc.returncode}: {err.strip()[-300:]})")
    return usage.ru_maxrss / 1024, proc.returncode, time.perf_counter() - t0


class Home:
    """A gpuctl home of its own with a local cluster, for one implementation (its source tree)."""

    def __init__(self, work: Path, src: Path):
        self.work, self.src = work, src
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
        self.env.update(GPUCTL_HOME=str(work / "home"), GPUCTL_PROVIDER="local", PYTHONPATH=str(src),
                        TF_CPP_MIN_LOG_LEVEL="2")
        work.mkdir(parents=True, exist_ok=True)

    def gpuctl(self, *args: str, check: bool = True) -> str:
        res = subprocess.run([str(PYTHON), "-m", "gpuctl", *args], env=self.env, cwd=self.work, capture_output=True,
                             text=True, timeout=600)
        if check and res.returncode:
            raise SystemExit(f"gpuctl {' '.join(args)} failed: {res.stderr}")
        return res.stdout

    def measure(self, *args: str) -> tuple[float, int, float]:
        return peak_mb([str(PYTHON), "-m", "gpuctl", *args], self.env, self.work)

    def finished_run(self, name: str, code: int) -> dict:
        """A run of QUICK that ended (exit `code`), looked at once."""
        proj = self.work / name
        proj.mkdir(exist_ok=True)
        (proj / "train.py").write_text(QUICK)
        run = json.loads(self.gpuctl("train", str(proj), "--json", "--", str(code)))["run"]
        deadline = time.monotonic() + 120
        while not (Path(run["run_dir"]) / "exitcode").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"the run {run['run_id']} did not end")
            time.sleep(0.5)
        return run


LINGER = QUICK.replace('sys.exit(', 'time.sleep(600)\nsys.exit(')


def live_run(home: Home, name: str) -> dict:
    """A run of LINGER that reported its epoch and goes on (`down` ends it)."""
    proj = home.work / name
    proj.mkdir(exist_ok=True)
    (proj / "train.py").write_text(LINGER)
    run = json.loads(home.gpuctl("train", str(proj), "--json"))["run"]
    deadline = time.monotonic() + 120
    while not (Path(run["run_dir"]) / "epochs.jsonl").exists() or b"\n" not in (
            Path(run["run_dir"]) / "epochs.jsonl").read_bytes():
        if time.monotonic() > deadline:
            raise SystemExit(f"the run {run['run_id']} reported nothing")
        time.sleep(0.2)
    return run


def write_log(path: Path, size: int) -> None:
    line = (b"x" * 99) + b"\n"
    block = line * (MB // len(line))
    with open(path, "wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)


def write_bomb(path: Path, size: int) -> None:
    z = zlib.compressobj(9)
    with open(path, "wb") as fh:
        fh.write(z.compress(b'{"a": "'))
        zeros = b"0" * (16 * MB)
        for _ in range(size // len(zeros)):
            fh.write(z.compress(zeros))
        fh.write(z.compress(b'"}') + z.flush())


def write_epochs(path: Path, run_id: str, size: int) -> None:
    now = time.time()
    with open(path, "wb") as fh:
        written, n = 0, 0
        while written < size:
            n += 1
            line = json.dumps({"schema": 1, "run_id": run_id, "epoch": n, "epochs_planned": None, "start": now - 2,
                               "end": now - 1, "seconds": 1.0, "examples": 100, "examples_estimated": False,
                               "examples_per_s": 100.0, "usd_per_hour": 1.0, "epoch_cost_usd": 0.0003,
                               "cumulative_usd": 0.0003 * n, "metrics": {"loss": 0.5, "accuracy": 0.9}}).encode() + b"\n"
            fh.write(line)
            written += len(line)


PREFLIGHT = '''
import json, sys
line = ("y" * 99 + "\\n").encode()
block = line * 10000
for _ in range(SIZE // len(block)):
    sys.stdout.buffer.write(block)
sys.stdout.buffer.write(json.dumps({"python": "3", "tensorflow": "2.21.0", "tf_gpus": []}).encode() + b"\\n")
'''

PREFLIGHT_CLIENT = '''
import sys
from gpuctl.remote.local import LocalHost
from gpuctl.remote.preflight import preflight
host = LocalHost(sys.argv[1])
print(preflight(host, sys.argv[1]))
'''


FAKE_SMI = '#!/bin/sh\nyes "GPU 0: Fake (UUID: a)" | head -c SIZE\n'

GPUS_CLIENT = '''
import sys
from gpuctl.ops import queue
from gpuctl.remote.local import LocalHost
print(queue.gpus_of(LocalHost(sys.argv[1])))
'''

GPUS_CLIENT_SSH = '''
import sys
from pathlib import Path
from gpuctl.model.endpoint import Endpoint
from gpuctl.ops import queue
from gpuctl.remote.ssh.host import SshHost
host = SshHost(Endpoint("root", sys.argv[1], 22, identity=sys.argv[2]), Path(sys.argv[3]), None, "/srv/gpuctl",
               connect_timeout_s=15, command_timeout_s=600)
# The fake nvidia-smi lives in the host's /srv (on its PATH only for this command).
res = host.run(["env", "PATH=/srv/fakebin:/usr/bin:/bin", "nvidia-smi", "-L"], check=False, timeout=600)
print(len(res.stdout), getattr(res, "dropped", "-"))  # an older gpuctl kept it all
'''


def output_cases(home: Home, size: int) -> dict[str, tuple[float, int, float]]:
    """The GPU count on a host whose nvidia-smi -L prints `size` bytes: here, and over SSH."""
    out = {}
    fake_bin = home.work / "fakebin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "nvidia-smi").write_text(FAKE_SMI.replace("SIZE", str(size)))
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = dict(home.env, PATH=f"{fake_bin}{os.pathsep}{home.env.get('PATH', '')}")
    out["output (local)"] = peak_mb([str(PYTHON), "-c", GPUS_CLIENT, str(home.work)], env, home.work)
    if os.geteuid() != 0:
        print("    (output over ssh: the sshd test hosts need root; not measured)")
        return out
    import sys

    sys.path.insert(0, str(ROOT))
    from tests import sshd

    with sshd.running_lab("bench", {1: "b1"}) as (key, hosts):
        host = hosts[0]
        script = shlex.quote(FAKE_SMI.replace("SIZE", str(size)))
        host.run(f"mkdir -p /srv/fakebin && printf %s {script} > /srv/fakebin/nvidia-smi && chmod 755 /srv/fakebin/nvidia-smi")
        out["output (ssh)"] = peak_mb([str(PYTHON), "-c", GPUS_CLIENT_SSH, host.ip, str(key), str(home.work / "ssh-home")],
                                      home.env, home.work)
    return out


def run_cases(home: Home, sizes: dict[str, int], only: set[str]) -> dict[str, tuple[float, int, float]]:
    out = {}
    home.gpuctl("up", "-y")
    out["none"] = home.measure("status")  # the same command with nothing hostile: what imports alone cost
    if "logs" in only or "status" in only:
        run = home.finished_run("failing", 3)
        write_log(Path(run["run_dir"]) / "output.log", sizes["logs"])
        if "logs" in only:
            out["logs"] = home.measure("logs", run["run_id"])
        if "status" in only:
            out["status"] = home.measure("status")
    if "sync" in only:
        proj = home.work / "synced"
        proj.mkdir(exist_ok=True)
        (proj / "train.py").write_text("pass\n")
        home.gpuctl("sync", str(proj))
        write_bomb(next((home.work / "home" / "clusters" / "default" / "code").glob(".synced-*.gpuctl-manifest")), sizes["sync"])
        out["sync"] = home.measure("sync", str(proj))
    if "preflight" in only:
        payload = home.work / "payload"
        payload.mkdir(exist_ok=True)
        (payload / "gpuctl_preflight.py").write_text(PREFLIGHT.replace("SIZE", str(sizes["preflight"])))
        out["preflight"] = peak_mb([str(PYTHON), "-c", PREFLIGHT_CLIENT, str(payload)], home.env, home.work)
    if "epochs" in only:
        run = home.finished_run("reporting", 0)
        home.gpuctl("status")  # the run's end is known: only its report file is new below
        write_epochs(Path(run["run_dir"]) / "epochs.jsonl", run["run_id"], sizes["epochs"])
        out["epochs"] = home.measure("status")
        out["epochs (again)"] = home.measure("status")
    if "sparse" in only:
        run = live_run(home, "sparse")  # a live run: a finished one's reports are not read again
        home.gpuctl("status")
        epochs = Path(run["run_dir"]) / "epochs.jsonl"
        line = epochs.read_bytes().splitlines(keepends=True)[0]
        subprocess.run(["truncate", "-s", f"+{sizes['sparse']}", str(epochs)], check=True)
        with open(epochs, "ab") as fh:
            fh.write(line)
        out["sparse"] = home.measure("status")
        out["sparse (again)"] = home.measure("status")
    if "output" in only:
        out.update(output_cases(home, sizes["output"]))
    home.gpuctl("down", "-y", check=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the audit's sizes (minutes, ~1.3 GB of disk)")
    ap.add_argument("--baseline", type=Path, help="another gpuctl source tree, measured side by side")
    ap.add_argument("--only", default="logs,status,sync,preflight,epochs,sparse,output")
    args = ap.parse_args()
    scale = 1 if args.full else 10
    sizes = {"logs": 400 * MB // scale, "status": 400 * MB // scale, "sync": 3 * 1024 * MB // scale,
             "preflight": 300 * MB // scale, "epochs": 228 * MB // scale, "sparse": 1024 * MB // scale,
             "output": 1024 * MB // scale}
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="gpuctl-bench-mem-") as tmp:
        results = {"this": run_cases(Home(Path(tmp) / "this", ROOT), sizes, only)}
        if args.baseline:
            results["baseline"] = run_cases(Home(Path(tmp) / "baseline", args.baseline.resolve()), sizes, only)
    print(f"\n{'case':<16}{'input':>10}{'peak RSS':>12}{'exit':>6}{'s':>7}" +
          (f"{'baseline RSS':>15}{'exit':>6}{'s':>7}" if args.baseline else ""))
    for case, (rss, code, secs) in results["this"].items():
        size = sizes.get(case.split()[0], 0)
        what = {"sync": "expanded", "sparse": "a hole", "output": "printed"}.get(case.split()[0], "")
        row = f"{case:<16}{size / MB:>7.0f} MB{rss:>9.1f} MB{code:>6}{secs:>7.1f}"
        if args.baseline and case in results["baseline"]:
            b_rss, b_code, b_secs = results["baseline"][case]
            row += f"{b_rss:>12.1f} MB{b_code:>6}{b_secs:>7.1f}"
        print(row + (f"  ({what})" if what else ""))
    worst = max(rss for rss, _, _ in results["this"].values())
    print(f"\nworst peak: {worst:.1f} MB (target: flat, well under 100 MB)")


if __name__ == "__main__":
    main()
