"""How fast a host fetches an S3 data set with gpuctl (gpuctl_fetch.py, from presigned links made
here) against the AWS CLI (`aws s3 sync`), from one moto server over loopback, same data:

    many    1 GB in 10,000 files
    few     1 GB in 10 files
    warm    the many-file set again, everything already there (gpuctl: its cache; the CLI: sync's
            own size-and-time comparison)

Each row: gpuctl's whole path as `train` runs it on a host (list the prefix, ask the host what it
lacks, sign links, fetch) and the payload's own seconds, the CLI's seconds, and the ratio (CLI /
gpuctl: above 1.0 gpuctl is faster); with each process's peak RSS. Both write to fresh
directories on the same disk. The CLI comes from .venv-bench (`python3 -m venv .venv-bench &&
.venv-bench/bin/pip install awscli`); without it, boto3's s3transfer (download_file on 10
threads, what `aws s3 cp` uses) is the baseline. moto serves both from this process: it is the
slowest part of either on two cores, so the ratio says more than the MB/s.

    .venv/bin/python bench/fetch.py                      # the issue's sizes (~3 GB of disk, minutes)
    .venv/bin/python bench/fetch.py --mb 50 --many 2000  # a quick run
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUCKET = "bench-data"
AWS_CLI = REPO / ".venv-bench" / "bin" / "aws"


def serve() -> str:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    return f"http://127.0.0.1:{port}"


def fill(s3, prefix: str, files: int, total_mb: float) -> None:
    size = int(total_mb * 1e6 / files)
    block = os.urandom(size)

    def put(i: int) -> None:
        # Each its own bytes (a different tail), so no two files are one.
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/part-{i // 1000:03d}/f{i:06d}.bin", Body=block[:-8] + i.to_bytes(8, "big"))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(files)))


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stdout) of argv, through /usr/bin/time for its RSS."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        start = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss.name, *argv], capture_output=True, env=env)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
        return seconds, int(rss.read().strip().splitlines()[-1]) / 1024, proc.stdout.decode()


def gpuctl_fetch(endpoint: str, prefix: str, dest: Path) -> dict[str, float]:
    """The host's side of `train --data s3://...` on this machine: list, `need`, sign, `fetch`."""
    from gpuctl.model.data import parse_s3
    from gpuctl.payloads import gpuctl_datacache as cache
    from gpuctl.provision.aws.datasets import S3DataSets

    start = time.perf_counter()
    reader = S3DataSets("", "us-east-1")
    listing = reader.listing(parse_s3(f"s3://{BUCKET}/{prefix}"))
    listed = time.perf_counter()
    root = dest / "data" / listing.source.place
    plan = {"version": cache.PLAN_VERSION, "dir": str(root), "source": listing.source.url, "threads": 16,
            "objects": [[r, s, e, None] for r, s, e in listing.objects]}
    missing = cache.need(cache.load_plan_data(dict(plan, objects=list(plan["objects"]))))["missing"]  # (a copy: made tuples)
    template, signed = reader.signer(listing, 3600)
    plan["link"] = template
    for i in missing:
        plan["objects"][i][3] = signed(listing.objects[i][0])
    signed = time.perf_counter()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "plan.json"
    path.write_text(json.dumps(plan))
    payload = REPO / "gpuctl" / "payloads" / "gpuctl_fetch.py"
    seconds, rss, out = timed([sys.executable, str(payload), "fetch", str(path)])
    result = json.loads(out.strip().splitlines()[-1])
    assert result.get("ok"), result
    return {"total": time.perf_counter() - start, "list": listed - start, "sign": signed - listed,
            "payload": seconds, "rss": rss, "fetched": result["fetched"], "cached": result["cached"]}


def cli_fetch(endpoint: str, prefix: str, dest: Path) -> tuple[float, float, str]:
    env = dict(os.environ)
    if AWS_CLI.exists():
        return (*timed([str(AWS_CLI), "s3", "sync", "--only-show-errors", "--endpoint-url", endpoint,
                        f"s3://{BUCKET}/{prefix}/", str(dest)], env)[:2], "aws s3 sync")
    code = (f"import boto3, os, sys\nfrom boto3.s3.transfer import TransferConfig\n"
            f"from concurrent.futures import ThreadPoolExecutor\n"
            f"s3 = boto3.client('s3', endpoint_url={endpoint!r})\n"
            f"keys = [o['Key'] for p in s3.get_paginator('list_objects_v2').paginate(Bucket={BUCKET!r}, "
            f"Prefix={prefix!r} + '/') for o in p.get('Contents', [])]\n"
            f"def get(k):\n    path = os.path.join({str(dest)!r}, k)\n    os.makedirs(os.path.dirname(path), "
            f"exist_ok=True)\n    s3.download_file({BUCKET!r}, k, path)\n"
            f"list(ThreadPoolExecutor(10).map(get, keys))\n")
    return (*timed([sys.executable, "-c", code], env)[:2], "boto3 s3transfer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=1000.0, help="size of each data set, MB (default: 1000)")
    ap.add_argument("--many", type=int, default=10_000, help="files in the many-file set (default: 10,000)")
    ap.add_argument("--few", type=int, default=10, help="files in the few-file set (default: 10)")
    args = ap.parse_args()

    endpoint = serve()
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                       "AWS_EC2_METADATA_DISABLED": "true"})
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=BUCKET)
    t = time.perf_counter()
    fill(s3, "many", args.many, args.mb)
    fill(s3, "few", args.few, args.mb)
    print(f"moto at {endpoint}: {args.many:,} files and {args.few:,} files of {args.mb:g} MB each set, "
          f"uploaded in {time.perf_counter() - t:.0f}s; {os.cpu_count()} cores")
    work = Path(tempfile.mkdtemp(prefix="gpuctl-bench-fetch-"))
    rows = []
    try:
        for name, prefix in (("many", "many"), ("few", "few")):
            ours = gpuctl_fetch(endpoint, prefix, work / f"gpuctl-{name}")
            cli_s, cli_rss, tool = cli_fetch(endpoint, prefix, work / f"cli-{name}")
            rows.append((name, ours, cli_s, cli_rss, tool))
        ours = gpuctl_fetch(endpoint, "many", work / "gpuctl-many")  # again: all of it there
        cli_s, cli_rss, tool = cli_fetch(endpoint, "many", work / "cli-many")
        rows.append(("warm", ours, cli_s, cli_rss, tool))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nbaseline: {rows[0][4]}")
    print(f"{'set':<6} {'files':>7} {'gpuctl s':>9} {'(list+sign)':>12} {'payload s':>10} {'MB/s':>7} "
          f"{'baseline s':>11} {'MB/s':>7} {'ratio':>6} {'RSS MB':>14}")
    for name, ours, cli_s, cli_rss, _ in rows:
        files = args.many if name != "few" else args.few
        mb = args.mb if name != "warm" else 0.0
        print(f"{name:<6} {files:>7,} {ours['total']:>9.2f} {ours['list'] + ours['sign']:>12.2f} "
              f"{ours['payload']:>10.2f} {mb / ours['total']:>7.1f} {cli_s:>11.2f} {mb / cli_s:>7.1f} "
              f"{cli_s / ours['total']:>5.2f}x {ours['rss']:>6.0f} / {cli_rss:<6.0f}")
        assert (ours["fetched"], ours["cached"]) == ((0, files) if name == "warm" else (files, 0)), ours
    print("\nratio = baseline seconds / gpuctl seconds (above 1.0x: gpuctl is faster); RSS: gpuctl's payload / "
          "the baseline's process")


if __name__ == "__main__":
    main()
