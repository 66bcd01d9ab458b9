"""Where the time of listing an S3 data set goes on this machine (issue 38: "a warm second fetch of
10,000 files: under 1 s"; the whole warm `train` was 7.2 s, nearly all of it the listing here):
the CLI's own CPU (signing, reading the XML, keeping the objects) against the S3 server's (moto,
in a process of its own so that its CPU is counted apart: /proc/PID/stat before and after).

Each reader lists the same prefix in a child process, several times (the best of each kept):

    this     this checkout's S3DataSets.listing (gpuctl's SigV4 over http.client, XMLPullParser)
    base     --baseline DIR's (another source tree, e.g. boto3's paginator before issue 38's fix)
    boto3    boto3's list_objects_v2 paginator alone, for reference

    .venv/bin/python bench/listing.py [--objects 10000] [--baseline DIR] [--runs 3]

Columns: wall seconds, the reader's CPU seconds, moto's CPU seconds in that time, peak RSS of the
reader (MB)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench-listing"
SERVER = """
import os, sys, time
from moto.server import ThreadedMotoServer
import logging
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
backend.create_bucket("%(bucket)s", "us-east-1")
for i in range(int(sys.argv[1])):
    backend.put_object("%(bucket)s", f"set/d{i // 1000:03d}/f{i:06d}.bin", i.to_bytes(8, "big"))
print("http://127.0.0.1:%%d" %% server.get_host_and_port()[1], flush=True)
sys.stdin.read()
""" % {"bucket": BUCKET}
READER = """
import json, resource, sys, time
start = time.perf_counter()
if sys.argv[1] == "boto3":
    import boto3
    s3 = boto3.session.Session().client("s3")
    n = sum(len(p.get("Contents", ())) for p in s3.get_paginator("list_objects_v2").paginate(Bucket=sys.argv[2], Prefix="set/"))
else:
    from gpuctl.model.data import parse_s3
    from gpuctl.provision.aws.datasets import S3DataSets
    n = len(S3DataSets("", "us-east-1").listing(parse_s3("s3://%s/set" % sys.argv[2])).objects)
wall = time.perf_counter() - start
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"n": n, "wall": wall, "cpu": use.ru_utime + use.ru_stime, "rss": use.ru_maxrss / 1024}))
"""


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, tree: Path | None, env: dict[str, str], moto_pid: int) -> dict[str, float]:
    run_env = {**env, "PYTHONPATH": str(tree)} if tree else env
    before = cpu_of(moto_pid)
    out = subprocess.run([sys.executable, "-c", READER, kind, BUCKET], capture_output=True, text=True, env=run_env,
                         check=True)
    row: dict[str, float] = json.loads(out.stdout)
    row["moto_cpu"] = cpu_of(moto_pid) - before
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another gpuctl source tree, measured beside this one")
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(args.objects)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        endpoint = (server.stdout.readline() if server.stdout else "").strip()
        with tempfile.TemporaryDirectory() as home:
            env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "AWS_"))},
                   "HOME": home, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                   "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                   "AWS_EC2_METADATA_DISABLED": "true"}
            kinds: list[tuple[str, str, Path | None]] = [("this", "gpuctl", REPO)]
            if args.baseline:
                kinds.append(("base", "gpuctl", args.baseline.resolve()))
            kinds.append(("boto3", "boto3", None))
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.runs):  # interleaved: the machine's load falls on each alike
                for name, kind, tree in kinds:
                    row = measure(kind, tree, env, server.pid)
                    assert row["n"] == args.objects, row
                    if name not in best or row["wall"] < best[name]["wall"]:
                        best[name] = row
        print(f"{args.objects:,} objects, moto in its own process, best of {args.runs}; {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'reader':<7} {'wall s':>7} {'its CPU s':>10} {'moto CPU s':>11} {'RSS MB':>7}")
        for name, r in best.items():
            print(f"{name:<7} {r['wall']:>7.2f} {r['cpu']:>10.2f} {r['moto_cpu']:>11.2f} {r['rss']:>7.0f}")
    finally:
        server.kill()
        server.wait()
        time.sleep(0)


if __name__ == "__main__":
    main()
