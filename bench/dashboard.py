"""How fast `gpuctl dashboard` is on a busy ledger (bench/cli_latency.py's: N runs x E epochs),
side by side with `gpuctl status --json` on the same ledger, in one run:

- server time of a look (ops/dashboard.Looker): the first, one with nothing new, and one after a
  new epoch reached the ledger (an update: that run alone is rebuilt);
- the page's first full render in headless Chromium (navigation start to the tables and the
  selected run's chart drawn), and a new epoch in the ledger to the page showing it (no reload);
- the server's peak memory (VmHWM).

Targets (issue 39, at 1,000 runs x 20 epochs): first render under 300 ms, an update under 50 ms of
server time, the server under 150 MB.

Usage: .venv/bin/python bench/dashboard.py [--runs 1000] [--epochs 20] [--repeat 5]
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

from bench.cli_latency import fill, gpuctl_argv  # noqa: E402
from gpuctl.ops import dashboard as ops  # noqa: E402
from gpuctl.ops.session import Session  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpuctl-bench-dash-"))
    fill(home, args.runs, args.epochs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")} | {"GPUCTL_HOME": str(home)}
    os.environ["GPUCTL_HOME"] = str(home)

    s = Session(home)
    looker = ops.Looker()
    t = time.perf_counter()
    looker.look(s, time.time())
    first = time.perf_counter() - t
    same, update = [], []
    for k in range(args.repeat):
        t = time.perf_counter()
        looker.look(s, time.time())
        same.append(time.perf_counter() - t)
        # A new epoch of one run reaches the ledger: the next look rebuilds that run alone.
        rid = f"bench-{k:05d}"
        last = s.ledger.epochs(rid)[-1]
        s.ledger.put_epochs([last.model_copy(update={"epoch": last.epoch + 1})])
        t = time.perf_counter()
        looker.look(s, time.time())
        update.append(time.perf_counter() - t)
        assert looker.rebuilt == 1, looker.rebuilt
    s.close()
    status = [timed([*gpuctl_argv(), "status", "--json"], env) for _ in range(args.repeat)]

    proc = subprocess.Popen([*gpuctl_argv(), "dashboard", "--no-open", "--interval", os.environ.get("BENCH_INTERVAL", "0.5")], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split(" ", 1)[1].strip()
        from playwright.sync_api import sync_playwright

        from tests.web import CHROMIUM, CHROMIUM_ARGS

        renders = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context().new_page()
            page.goto(url)  # the cookie; the first load of the assets
            for _ in range(args.repeat):
                page.reload()
                page.wait_for_selector("#run-epochs tr:nth-child(2)")
                renders.append(page.evaluate("performance.now()") / 1000)
            # An epoch reaches the ledger (as a look of a live run records it): until the page shows it.
            rid = f"bench-{args.runs - 1:05d}"
            led = Session(home)
            latencies = []
            for _ in range(args.repeat):
                last = led.ledger.epochs(rid)[-1]
                t = time.perf_counter()
                led.ledger.put_epochs([last.model_copy(update={"epoch": last.epoch + 1})])
                page.wait_for_function(f"() => (document.querySelector('#runs tr[data-run=\"{rid}\"]') || "
                                       f"{{}}).innerText?.includes('{last.epoch + 1}/')", timeout=30000)
                latencies.append(time.perf_counter() - t)
            led.close()
            browser.close()
        rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait()
    med = statistics.median
    print(f"ledger: {args.runs} runs x {args.epochs} epochs; median of {args.repeat}")
    print(f"gpuctl status --json          {med(status) * 1000:7.0f} ms")
    print(f"first look (server)           {first * 1000:7.0f} ms   ({first / med(status):.2f}x status --json)")
    print(f"a look, nothing new (server)  {med(same) * 1000:7.0f} ms   ({med(same) / med(status):.2f}x status --json)")
    print(f"a look, a new epoch (server)  {med(update) * 1000:7.0f} ms   ({med(update) / med(status):.2f}x status --json)"
          "  target 50 ms")
    print(f"page's full render (Chromium) {med(renders) * 1000:7.0f} ms   ({med(renders) / med(status):.2f}x status --json)"
          "  target 300 ms")
    print(f"a new epoch on the page       {med(latencies) * 1000:7.0f} ms   (--interval 0.5)  target 2,000 ms")
    print(f"server peak RSS               {rss:7.0f} MB   target 150 MB")


if __name__ == "__main__":
    main()
