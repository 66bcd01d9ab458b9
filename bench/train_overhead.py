"""What `gpuctl train --wait` costs on top of the training itself: a small Keras project (real
TensorFlow, 2 tiny epochs) run by `gpuctl train --wait` against plain `python train.py`, on the
local provider and on a real sshd test host (a network namespace; needs root) over the same SSH.

Each round, in turn: plain python, then a new cluster's first `train --wait`, then its second;
the figure is the median of --repeat rounds, the overhead each median less plain python's. On
ssh each round's cluster is made on a host whose preflight cache was emptied first (as a fresh
instance): its `up` starts the preflight in the background, and the first train comes right
after the `up` (a user is slower), so it may still wait for part of that TensorFlow import (each
round's line says how long its `up` took). Targets: a second
`train` within 2 s of plain python on both, a first within 4 s.

The ssh host's Python (and plain python's there) is a venv with only tensorflow-cpu of this
checkout's version, as gpuctl's setup step makes on an instance: this checkout's .venv has
scikit-learn, scipy and matplotlib beside it (for the tests), which Keras imports when they are
there, and its TensorFlow import takes ~7 s on two cores instead of ~4. The venv is made once with
pip (from the configured index) and kept in /var/tmp; --python PATH runs another.

--timeline prints, for the last round, when each of gpuctl's progress lines came (seconds from the
command's start): where the seconds go.

Usage: sudo .venv/bin/python bench/train_overhead.py [--repeat 5] [--only local|ssh] [--timeline]
       [--python PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import sshd  # noqa: E402
from tests.integration.test_payload_tf import MODEL  # noqa: E402

GPUCTL = [sys.executable, "-m", "gpuctl"]
FIRST_TARGET_S, SECOND_TARGET_S = 4.0, 2.0

# The payload tests' tiny Keras model (100 examples), two epochs.
TRAIN = textwrap.dedent(MODEL) + 'model.fit(x, y, batch_size=20, epochs=2, verbose=2)\nprint("trained")\n'


def timed(argv: list[str], env: dict[str, str], cwd: Path | str | None = None) -> tuple[float, list[tuple[float, str]]]:
    """(seconds, [(seconds since start, stderr line)]) of a command that must succeed."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    took = time.monotonic() - start
    reader.join(10)
    if proc.returncode != 0 or "trained" not in out and argv[-1] != "-y" and "train" in argv:
        tail = "\n".join(text for _, text in lines[-30:])
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{out[-2000:]}\n{tail}")
    return took, lines


def lean_python() -> str:
    """A venv with tensorflow-cpu of this checkout's version and nothing else, made once."""
    try:
        dist = "tensorflow-cpu"
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # not x86_64: pyproject installs tensorflow
        dist = "tensorflow"
        version = importlib.metadata.version(dist)
    where = Path(f"/var/tmp/gpuctl-bench-tf{version}")
    python = where / "bin" / "python"
    if not (where / ".complete").exists():
        print(f"making {where} ({dist}=={version}), once", flush=True)
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"{dist}=={version}"], check=True)
        (where / ".complete").touch()
    return str(python)


class Local:
    name = "local"

    def __init__(self, base: Path, env: dict[str, str]):
        self.env = {**env, "GPUCTL_PROVIDER": "local"}
        self.project = base / "project"

    def plain(self) -> float:
        return timed([sys.executable, "train.py"], self.env, cwd=self.project)[0]

    def up(self, name: str) -> float:
        return timed([*GPUCTL, "up", "--name", name], self.env)[0]

    def fresh_instance(self) -> None:
        pass  # nothing of a local cluster's outlives its `down`

    def down(self, name: str) -> None:
        timed([*GPUCTL, "down", name, "-y"], self.env)


class Ssh:
    name = "ssh"

    def __init__(self, base: Path, env: dict[str, str], python: str):
        self.python = python
        self.key = sshd.client_key(base / "keys")
        self.host = sshd.TestHost(8, base / "host", tag=f"t{os.getpid()}", srv_size="1g")
        self.host.create(self.key.with_suffix(".pub").read_text())
        self.host.start()
        self.env = {**env, "GPUCTL_PROVIDER": "ssh", "GPUCTL_REMOTE__WORKDIR": sshd.WORKDIR,
                    "GPUCTL_REMOTE__PYTHON": python}
        self.known = base / "known_hosts"
        subprocess.run(["sh", "-c", f"ssh-keyscan -t ed25519 {self.host.ip} > {self.known} 2>/dev/null"], check=True)
        self.ssh = ["ssh", "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
                    "-o", f"UserKnownHostsFile={self.known}", "-o", "StrictHostKeyChecking=yes",
                    "-o", "BatchMode=yes", self.host.address]
        self.host.run(f"mkdir -p /srv/plain && cp {shlex.quote(str(base / 'project' / 'train.py'))} /srv/plain/")

    def plain(self) -> float:
        # The same SSH a user would type: one connection, the login shell, python, the output back.
        cmd = f"cd /srv/plain && TF_CPP_MIN_LOG_LEVEL=2 {shlex.quote(self.python)} train.py"
        return timed([*self.ssh, cmd], self.env)[0]

    def up(self, name: str) -> float:
        return timed([*GPUCTL, "up", "--name", name, "--host", self.host.address, "--identity", str(self.key)],
                     self.env)[0]

    def fresh_instance(self) -> None:
        self.host.run(f"rm -rf {sshd.WORKDIR}/_preflight")  # what a new instance has not seen

    def down(self, name: str) -> None:
        timed([*GPUCTL, "down", name, "-y"], self.env)

    def close(self) -> None:
        self.host.destroy()


def rounds(where, project: Path, repeat: int) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, str]]]]:
    times: dict[str, list[float]] = {"plain": [], "up": [], "first": [], "second": []}
    lines: dict[str, list[tuple[float, str]]] = {}
    for i in range(repeat):
        times["plain"].append(where.plain())
        name = f"ovh{os.getpid() % 10000}x{i}"
        where.fresh_instance()
        times["up"].append(where.up(name))
        try:
            for which in ("first", "second"):
                took, lines[which] = timed([*GPUCTL, "train", str(project), "--cluster", name, "--allow-cpu", "--wait"],
                                           where.env)
                times[which].append(took)
        finally:
            where.down(name)
        print(f"  {where.name} round {i + 1}: plain {times['plain'][-1]:.2f} s, up {times['up'][-1]:.2f} s, "
              f"first {times['first'][-1]:.2f} s, second {times['second'][-1]:.2f} s", flush=True)
    return times, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", choices=("local", "ssh"))
    ap.add_argument("--timeline", action="store_true", help="when each progress line came, last round")
    ap.add_argument("--python", help="the ssh host's Python (default: a venv with tensorflow-cpu only)")
    args = ap.parse_args()
    kinds = [args.only] if args.only else ["local", "ssh"]
    if args.repeat < 1:
        sys.exit(f"bench/train_overhead: --repeat {args.repeat}: give 1 or more rounds")
    if args.python and not (os.path.isabs(args.python) and os.access(args.python, os.X_OK)):
        sys.exit(f"bench/train_overhead: --python {args.python!r} is not an absolute path to an executable "
                 "(the ssh test host runs it as given)")
    if "ssh" in kinds:
        why = sshd.available()
        if why:
            sys.exit(f"bench/train_overhead: {why}")
        sshd.cleanup_stale()
    base = Path(tempfile.mkdtemp(prefix="gpuctl-bench-", dir="/var/tmp"))
    try:
        (base / "project").mkdir()
        (base / "project" / "train.py").write_text(TRAIN)
        # gpuctl's bytecode is cached as an installed package's is (even where PYTHONDONTWRITEBYTECODE is
        # set here): compiling its sources would add ~0.1 s to every command.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_") and k != "PYTHONDONTWRITEBYTECODE"}
        env.update(GPUCTL_HOME=str(base / "home"), HOME=str(base / "user"), TF_CPP_MIN_LOG_LEVEL="2")
        (base / "user").mkdir()
        verdicts = []
        print(f"median of {args.repeat} rounds; each round: plain python, a new cluster's first train --wait, its second")
        for kind in kinds:
            where = Local(base, env) if kind == "local" else Ssh(base, env, args.python or lean_python())
            try:
                times, lines = rounds(where, base / "project", args.repeat)
            finally:
                if kind == "ssh":
                    where.close()
            plain = statistics.median(times["plain"])
            for which, target in (("first", FIRST_TARGET_S), ("second", SECOND_TARGET_S)):
                median = statistics.median(times[which])
                over = median - plain
                verdicts.append(f"{kind:<6}{which:<8}{median:>9.2f}{plain:>9.2f}{over:>10.2f}   "
                                f"{'ok' if over <= target else 'OVER'} (target {target:g} s)")
                if args.timeline:
                    print(f"\n{kind}, {which} train, last round (seconds from the start: progress line):")
                    for at, text in lines[which]:
                        print(f"  {at:6.2f}  {text[:110]}")
        print(f"\n{'where':<6}{'train':<8}{'gpuctl':>9}{'plain':>9}{'overhead':>10}")
        for line in verdicts:
            print(line)
    finally:  # a failed round leaves nothing here either
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
