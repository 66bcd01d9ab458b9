"""Memory of an S3 data set's fetch (issue 38: "peak RSS under 100 MB ... for a listing of 100,000
objects and a fetch of 5 GB"), on this machine, both sides:

    CLI      `gpuctl train PROJECT --data s3://...` on the local provider, the whole command (list,
             check every key, ask the host what it lacks, sign a link for each object, write the
             plan, follow the fetch's progress to its end), in a child process: its peak RSS
    payload  the host's side as train runs it: gpuctl_fetch.py `need` and `fetch` on the plan
             train wrote (with its links), each in a child process: their peak RSS

Cases: `many`: 100,000 objects of 1 byte (the listing is the load); `big`: 5 GB in 50 objects of
100 MB each (the bytes are the load). moto serves both from this process (ThreadedMotoServer; the
objects are put straight into its backend, not over HTTP: 100,000 PUTs would take minutes on two
cores). Peak RSS: /usr/bin/time's (wait4's ru_maxrss) of each child alone, not moto's. Sizes can be made
smaller for a quick run: --many 10000 --gb 0.5.

    .venv/bin/python bench/data_memory.py                 # the issue's sizes (~10 GB of disk, minutes)
    .venv/bin/python bench/data_memory.py --baseline DIR  # the CLI of another source tree beside it
                                                          # (e.g. `git archive main | tar -x -C DIR`)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from fetch import serve  # noqa: E402  (bench/fetch.py: moto in this process)
BUCKET = "bench-memory"
PAYLOAD = REPO / "gpuctl" / "payloads" / "gpuctl_fetch.py"
TARGET_MB = 100


def fill(prefix: str, count: int, size: int) -> None:
    """`count` objects of `size` bytes under prefix/, put into moto's backend directly; each its
    own bytes (a different tail)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    block = os.urandom(size) if size else b""
    for i in range(count):
        body = block[:-8] + i.to_bytes(8, "big") if size >= 8 else block
        backend.put_object(BUCKET, f"{prefix}/d{i // 1000:03d}/f{i:06d}.bin", body)


def measured(argv: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    """(seconds, stdout, stderr) of argv; SystemExit when it fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, env=env, cwd=env["HOME"])
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:6]} failed ({proc.returncode}):\n{proc.stderr.decode()[-3000:]}")
    return time.perf_counter() - start, proc.stdout.decode(), proc.stderr.decode()


def child(argv: list[str], env: dict[str, str]) -> tuple[float, float, str, str]:
    """(seconds, peak RSS MB, stdout, stderr) of argv, through /usr/bin/time (wait4's ru_maxrss of
    that child alone)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        seconds, out, err = measured(["/usr/bin/time", "-f", "%M", "-o", rss.name, *argv], env)
        return seconds, int(rss.read().strip().splitlines()[-1]) / 1024, out, err


def baseline_cli(name: str, prefix: str, work: Path, endpoint: str, tree: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB) of `gpuctl train` run from another source tree (PYTHONPATH before
    this checkout's editable install), on the same moto and objects."""
    home, user, project = work / name / "home", work / name / "user", work / name / "project"
    user.mkdir(parents=True)
    project.mkdir()
    (project / "train.py").write_text("print('ok')\n")
    env = {**_env(home, user, endpoint), "PYTHONPATH": str(tree)}
    gpuctl = [sys.executable, "-m", "gpuctl"]
    child([*gpuctl, "up", "-y", "--usd-per-hour", "1"], env)
    seconds, rss, _, _ = child([*gpuctl, "train", str(project), "--data", f"s3://{BUCKET}/{prefix}", "--json"], env)
    child([*gpuctl, "down", "-y"], env)
    shutil.rmtree(work / name, ignore_errors=True)
    return seconds, rss


def _env(home: Path, user: Path, endpoint: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")},
            "GPUCTL_HOME": str(home), "HOME": str(user), "GPUCTL_PROVIDER": "local",
            "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}


def case(name: str, prefix: str, work: Path, endpoint: str, cli_only: bool = False) -> dict[str, float]:
    home, user = work / name / "home", work / name / "user"
    user.mkdir(parents=True)
    project = work / name / "project"
    project.mkdir()
    (project / "train.py").write_text("print('ok')\n")
    env = _env(home, user, endpoint)
    gpuctl = [sys.executable, "-m", "gpuctl"]
    child([*gpuctl, "up", "-y", "--usd-per-hour", "1"], env)
    seconds, rss, out, err = child([*gpuctl, "train", str(project), "--data", f"s3://{BUCKET}/{prefix}", "--json"], env)
    fetched = json.loads(out)["data_fetch"]
    row = {"cli_s": seconds, "cli_rss": rss, "files": fetched["fetched"] + fetched["cached"],
           "bytes": fetched["fetched_bytes"], "fetch_s": fetched["seconds"]}
    if cli_only:
        child([*gpuctl, "down", "-y"], env)
        shutil.rmtree(work / name, ignore_errors=True)
        return {**row, "need_s": 0.0, "need_rss": 0.0, "fetch_payload_s": 0.0, "fetch_rss": 0.0, "plan_mb": 0.0}
    # The payload's side: the plan train wrote, kept for this (train deletes it): written again
    # here from the same listing, with links, as train does (datasets._plan).
    plan = _plan(home, prefix, env)
    store = Path(json.loads(plan.read_text())["dir"])
    shutil.rmtree(store)
    shutil.rmtree(store.parent / f".{store.name}.gpuctl-fetch")
    row["need_s"], row["need_rss"], _, _ = child([sys.executable, str(PAYLOAD), "need", str(plan)], env)
    row["fetch_payload_s"], row["fetch_rss"], out, _ = child([sys.executable, str(PAYLOAD), "fetch", str(plan)], env)
    assert json.loads(out.strip().splitlines()[-1])["fetched"] == row["files"], out
    row["plan_mb"] = plan.stat().st_size / 1e6
    child([*gpuctl, "down", "-y"], env)
    shutil.rmtree(work / name, ignore_errors=True)
    return row


def _plan(home: Path, prefix: str, env: dict[str, str]) -> Path:
    """The plan train writes on the host, links and all (made here in a child: the sign step is
    the CLI's and is in its figure already)."""
    code = f"""
import json, os, sys
from gpuctl.model.data import parse_s3
from gpuctl.payloads import gpuctl_datacache as cache
from gpuctl.provision.aws.datasets import S3DataSets
reader = S3DataSets("", "us-east-1")
listing = reader.listing(parse_s3("s3://{BUCKET}/{prefix}"))
template, signed = reader.signer(listing, 3600)
root = os.path.join({str(home)!r}, "clusters", "default", "data", listing.source.place)
plan = {{"version": cache.PLAN_VERSION, "dir": root, "source": listing.source.url, "threads": 16, "link": template,
        "objects": [[r, s, e, signed(r)] for r, s, e in listing.objects]}}
with open(sys.argv[1], "w") as fh:
    json.dump(plan, fh)
"""
    path = home / "bench-plan.json"
    child([sys.executable, "-c", code, str(path)], {**env, "PYTHONPATH": str(REPO)})
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--many", type=int, default=100_000, help="objects in the listing case (default: 100,000)")
    ap.add_argument("--gb", type=float, default=5.0, help="GB in the big case (default: 5)")
    ap.add_argument("--objects", type=int, default=50, help="objects the big case's bytes are in (default: 50)")
    ap.add_argument("--cli-only", action="store_true", help="the CLI's train alone (not the payload's steps again)")
    ap.add_argument("--baseline", type=Path, help="another gpuctl source tree: its CLI measured beside this one's")
    args = ap.parse_args()
    endpoint = serve()
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(BUCKET, "us-east-1")
    t = time.perf_counter()
    fill("many", args.many, 1)
    fill("big", args.objects, int(args.gb * 1e9 / args.objects))
    print(f"moto at {endpoint}: {args.many:,} objects of 1 byte; {args.gb:g} GB in {args.objects} objects; "
          f"put in {time.perf_counter() - t:.0f}s; {os.cpu_count()} cores")
    work = Path(tempfile.mkdtemp(prefix="gpuctl-bench-memory-"))
    rows = {}
    try:
        rows["many"] = case("many", "many", work, endpoint, args.cli_only)
        rows["big"] = case("big", "big", work, endpoint, args.cli_only)
        if args.baseline:
            for name in rows:
                rows[name]["base_s"], rows[name]["base_rss"] = baseline_cli(
                    f"base-{name}", name, work, endpoint, args.baseline.resolve())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'case':<5} {'files':>8} {'GB':>5} {'plan MB':>8} | {'CLI train s':>11} {'RSS MB':>7} | "
          f"{'need s':>7} {'RSS MB':>7} | {'fetch s':>8} {'RSS MB':>7}")
    for name, r in rows.items():
        print(f"{name:<5} {r['files']:>8,} {r['bytes'] / 1e9:>5.2f} {r['plan_mb']:>8.1f} | {r['cli_s']:>11.1f} "
              f"{r['cli_rss']:>7.0f} | {r['need_s']:>7.1f} {r['need_rss']:>7.0f} | {r['fetch_payload_s']:>8.1f} "
              f"{r['fetch_rss']:>7.0f}")
    if args.baseline:
        print(f"\nthe CLI's `train` from {args.baseline} on the same objects:")
        for name, r in rows.items():
            print(f"{name:<5} baseline {r['base_s']:>6.1f} s {r['base_rss']:>5.0f} MB | this tree {r['cli_s']:>6.1f} s "
                  f"{r['cli_rss']:>5.0f} MB")
    worst = max(max(r["cli_rss"], r["need_rss"], r["fetch_rss"]) for r in rows.values())
    print(f"\ntarget: peak RSS under {TARGET_MB} MB in every column: "
          f"{'met' if worst < TARGET_MB else f'MISSED (worst {worst:.0f} MB)'}")


if __name__ == "__main__":
    main()
