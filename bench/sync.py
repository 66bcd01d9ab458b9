"""Push speed: gpuctl's push against plain `rsync -a` over the same SSH and against naive
one-file-at-a-time SFTP, to a real sshd test host (a network namespace; needs root).

Cases: first push, no-op push, one file changed. Prints seconds and bytes sent, and the ratios.
Targets: gpuctl within 1.2x of rsync in every case; at least 10x faster than per-file SFTP on
the first push of many small files. gpuctl's path for hosts without rsync (one tar stream,
`gpuctl tar`) within 1.5x of rsync, and its memory flat: the peak of Python's allocations while
it pushes one large file and one four times larger is printed side by side.

The test host sits on a veth link with next to no latency, where per-file round trips cost
nothing; a real instance is 5-50 ms away. --rtt-ms puts a latency-only TCP proxy (no bandwidth
limit, pipelining kept) between the client and sshd; all three tools go through it.

Usage: sudo .venv/bin/python bench/sync.py [--small 2000] [--large 2] [--large-mb 20] [--repeat 3] [--rtt-ms 5]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuctl.model.endpoint import Endpoint  # noqa: E402
from gpuctl.remote.ssh.host import SshHost  # noqa: E402
from tests import sshd  # noqa: E402


class DelayProxy:
    """127.0.0.1:port -> target, each chunk delivered `rtt/2` after it was read, in order."""

    def __init__(self, target: tuple[str, int], rtt_ms: float):
        import asyncio
        import threading

        self.target, self.delay = target, rtt_ms / 2000.0
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, context: None)  # resets at teardown are expected
        ready = threading.Event()

        async def start() -> None:
            self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    async def handle(self, reader, writer) -> None:
        import asyncio

        up_r, up_w = await asyncio.open_connection(*self.target)

        async def pump(src, dst) -> None:
            queue: asyncio.Queue = asyncio.Queue()

            async def read() -> None:
                while True:
                    data = await src.read(65536)
                    queue.put_nowait((self.loop.time() + self.delay, data))
                    if not data:
                        return

            async def write() -> None:
                while True:
                    due, data = await queue.get()
                    await asyncio.sleep(max(0.0, due - self.loop.time()))
                    if not data:
                        dst.close()
                        return
                    dst.write(data)
                    await dst.drain()

            await asyncio.gather(read(), write(), return_exceptions=True)

        await asyncio.gather(pump(reader, up_w), pump(up_r, writer), return_exceptions=True)


def make_project(root: Path, small: int, large: int, large_mb: int) -> None:
    rnd = os.urandom
    for i in range(small):
        p = root / f"pkg{i % 30}" / f"mod_{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd(1024 + (i * 37) % 3072))
    for i in range(large):
        (root / f"weights_{i}.bin").write_bytes(rnd(large_mb * 1024 * 1024))


def rsync_push(host: SshHost, src: Path, dest: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = subprocess.run(["rsync", "-a", "--stats", "-e", shlex.join(host.ssh_argv()), f"{src}/",
                          f"{host.ep.user}@{host.ep.host}:{dest}/"], capture_output=True, text=True, check=True).stdout
    sent = next(int(line.split(":")[1].split()[0].replace(",", "")) for line in out.splitlines()
                if line.startswith("Total bytes sent"))
    return time.perf_counter() - t0, sent


def sftp_push(host: SshHost, src: Path, dest: str, only: list[str] | None = None) -> tuple[float, int]:
    """The naive way: one SFTP put per file (over one connection), mkdir per directory."""
    t0 = time.perf_counter()
    sftp = host.sftp
    made, sent = set(), 0
    files = only if only is not None else [str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()]
    for rel in files:
        d = os.path.dirname(f"{dest}/{rel}")
        parts = d.split("/")
        for n in range(2, len(parts) + 1):
            sub = "/".join(parts[:n])
            if sub and sub not in made:
                try:
                    sftp.mkdir(sub)
                except OSError:
                    pass
                made.add(sub)
        sftp.put(str(src / rel), f"{dest}/{rel}")
        sent += (src / rel).stat().st_size
    return time.perf_counter() - t0, sent


def gpuctl_push(host: SshHost, src: Path, dest: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    stats = host.push(src, dest)
    return time.perf_counter() - t0, stats.bytes_copied


def gpuctl_tar_push(host: SshHost, src: Path, dest: str) -> tuple[float, int]:
    """gpuctl as on a host without rsync: the tar stream."""
    host.has_rsync = False
    try:
        return gpuctl_push(host, src, dest)
    finally:
        host.has_rsync = None


def tar_memory(host: SshHost, base: Path, mb: int) -> float:
    """Peak MB of Python allocations while the tar path pushes one file of `mb` MB."""
    import tracemalloc

    src = base / f"mem-{mb}"
    src.mkdir()
    with open(src / "big.bin", "wb") as fh:
        for _ in range(mb):
            fh.write(os.urandom(1024 * 1024))
    dest = f"/srv/mem-{mb}"
    host.has_rsync = False
    tracemalloc.start()
    try:
        host.push(src, dest)
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()
        host.has_rsync = None
        host.run(["rm", "-rf", dest, f"/srv/.mem-{mb}.gpuctl-manifest"])
        shutil.rmtree(src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--large", type=int, default=2)
    ap.add_argument("--large-mb", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rtt-ms", type=float, default=5.0, help="emulated round-trip time (0: none)")
    args = ap.parse_args()
    why = sshd.available()
    if why:
        sys.exit(f"bench/sync: {why}")
    sshd.cleanup_stale()
    base = Path(tempfile.mkdtemp(prefix="gpuctl-bench-", dir="/var/tmp"))
    key = sshd.client_key(base / "keys")
    host = sshd.TestHost(9, base / "host", tag=f"b{os.getpid()}", srv_size="2g")
    try:
        host.create(key.with_suffix(".pub").read_text())
        host.start()
        project = base / "project"
        make_project(project, args.small, args.large, args.large_mb)
        total = sum(p.stat().st_size for p in project.rglob("*") if p.is_file())
        print(f"project: {args.small} small files + {args.large} x {args.large_mb} MB = {total / 1e6:.1f} MB; "
              f"median of {args.repeat} runs each (sftp/file: 1); round trip {args.rtt_ms:g} ms")
        if args.rtt_ms > 0:
            proxy = DelayProxy((host.ip, 22), args.rtt_ms)
            ep = Endpoint("root", "127.0.0.1", proxy.port)
        else:
            ep = Endpoint("root", host.ip)
        conn = SshHost(ep, base / "home", str(key), "/srv")
        results: dict[str, dict[str, tuple[float, int]]] = {}
        for tool, push in (("gpuctl", gpuctl_push), ("gpuctl tar", gpuctl_tar_push), ("rsync -a", rsync_push),
                           ("sftp/file", sftp_push)):
            rows: dict[str, list[tuple[float, int]]] = {"first push": [], "no-op push": [], "one file changed": []}
            for rep in range(1 if tool == "sftp/file" else args.repeat):  # the slow baseline: once
                dest = f"/srv/{tool.replace(' ', '-').replace('/', '')}-{rep}"
                conn.run(["rm", "-rf", dest, f"/srv/.{os.path.basename(dest)}.gpuctl-manifest"])
                rows["first push"].append(push(conn, project, dest))
                if tool == "sftp/file":  # naive: it cannot know what changed, so it sends it all again
                    rows["no-op push"].append(push(conn, project, dest))
                else:
                    rows["no-op push"].append(push(conn, project, dest))
                target = project / "pkg3" / "mod_3.py"
                target.write_bytes(os.urandom(2048))
                if tool == "sftp/file":
                    rows["one file changed"].append(push(conn, project, dest, ["pkg3/mod_3.py"]))
                else:
                    rows["one file changed"].append(push(conn, project, dest))
            results[tool] = {case: (statistics.median(t for t, _ in v), int(statistics.median(b for _, b in v)))
                             for case, v in rows.items()}
        small_mb, big_mb = args.large_mb, 4 * args.large_mb
        peaks = (tar_memory(conn, base, small_mb), tar_memory(conn, base, big_mb))
        conn.close()
        print(f"{'case':<18}{'tool':<11}{'seconds':>9}{'bytes sent':>14}{'x rsync':>9}")
        verdicts = []
        for case in ("first push", "no-op push", "one file changed"):
            base_t = results["rsync -a"][case][0]
            for tool in ("gpuctl", "gpuctl tar", "rsync -a", "sftp/file"):
                t, b = results[tool][case]
                print(f"{case:<18}{tool:<11}{t:>9.3f}{b:>14,}{t / base_t:>9.2f}")
            ratio = results["gpuctl"][case][0] / base_t
            verdicts.append(f"{case}: gpuctl/rsync = {ratio:.2f} ({'ok' if ratio <= 1.2 else 'OVER 1.2'})")
            tar_ratio = results["gpuctl tar"][case][0] / base_t
            verdicts.append(f"{case}: gpuctl tar/rsync = {tar_ratio:.2f} ({'ok' if tar_ratio <= 1.5 else 'OVER 1.5'})")
        speedup = results["sftp/file"]["first push"][0] / results["gpuctl"]["first push"][0]
        verdicts.append(f"first push: sftp/gpuctl = {speedup:.1f}x ({'ok' if speedup >= 10 else 'UNDER 10x'})")
        flat = peaks[1] <= peaks[0] * 1.5 + 1
        verdicts.append(f"tar path memory: peak {peaks[0]:.1f} MB pushing {small_mb} MB, {peaks[1]:.1f} MB pushing "
                        f"{big_mb} MB ({'flat' if flat else 'GROWS with the tree'})")
        print("\n".join(verdicts))
        sys.stdout.flush()
    finally:
        host.destroy()
        shutil.rmtree(base, ignore_errors=True)
        os._exit(0)  # the proxy's loop thread holds half-closed tasks; nothing is left to flush


if __name__ == "__main__":
    main()
