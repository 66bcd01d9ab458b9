"""Issue 35 §4, bounds everywhere an instance answers, on real parts: an sshd test host whose
commands print hundreds of MB or hang, a sparse epochs.jsonl of 1 GB made with truncate on the
local provider (real tmux, a real job), a malformed entry in the instance's queue directory with
the real queue payload, and a queue.json that moves a run's start into the future.

Bad inputs tried: 64 MB printed by a command over SSH, a command over SSH that prints forever, a
probe that never answers over SSH (a command printing forever
over SSH already met its deadline); 1 GB of NULs (a hole) as epochs.jsonl, before and between
report lines, and 100 MB of one line without an end; queue entries that are not JSON, a list, a
dict without its keys, `held` as a string, a pid of 10**30, a directory named like an entry; a
queue.json with `started_at` 540 days ahead, before the run was asked for, and `share` 0."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuctl.model import untrusted
from gpuctl.model.endpoint import Endpoint
from gpuctl.remote.local import LocalHost
from gpuctl.ops import queue
from gpuctl.remote.host import MAX_OUTPUT
from gpuctl.remote.ssh.host import SshHost
from tests import sshd
from tests.conftest import HOST_PYTHON
from tests.integration.test_guards import wait_for
from tests.integration.test_hostile_instance import LINGERING, clean_and_ok, lingering_run  # noqa: F401 (a fixture)

MB = 1 << 20


def connect(lab, home) -> SshHost:
    h = lab.hosts[0]
    ep = Endpoint("root", h.ip, 22, identity=str(lab.key))
    return SshHost(ep, home, None, sshd.WORKDIR, python=str(HOST_PYTHON), connect_timeout_s=15)


def test_output_over_ssh_comes_back_as_its_tail_and_a_count(ssh, tmp_path):
    host = connect(ssh, tmp_path / "home")
    try:
        res = host.run(["sh", "-c", "yes 0123456789abcdef | head -c 67108864; echo; echo last line; "
                        "yes e | head -c 3000000 >&2; echo err end >&2"])
        assert len(res.stdout) <= MAX_OUTPUT and res.stdout.endswith("\nlast line\n")
        assert len(res.stderr) <= MAX_OUTPUT and res.stderr.endswith("e\nerr end\n")
        assert res.dropped == 64 * MB + 11 + 3000000 + 8 - len(res.stdout) - len(res.stderr)
    finally:
        host.close()


def test_a_probe_over_ssh_that_hangs_answers_124_and_the_host_answers_on(ssh, tmp_path):
    host = connect(ssh, tmp_path / "home")
    try:
        res = host.run(["sleep", "600"], timeout=1, probe=True, check=False)
        assert res.returncode == 124 and "no answer within 1 s" in res.stderr
        assert host.hung is None and host.run(["echo", "still here"]).stdout == "still here\n"
    finally:
        host.close()


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_a_hanging_nvidia_smi_leaves_train_to_start_with_gpus_unknown(gpuctl, quick_project, tmp_path, monkeypatch):
    """The local provider, real tmux: nvidia-smi on PATH never answers (the one mock: no GPU can
    exist here). The host was counted hung after it and `train` failed; now the run starts and
    succeeds, and `train` says the GPUs are unknown."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 600\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("GPUCTL_REMOTE__COMMAND_TIMEOUT_S", "5")
    monkeypatch.setattr(queue, "PROBE_S", 1.0, raising=False)
    gpuctl("up", "-y")
    res = gpuctl("train", quick_project, "--wait")
    assert "nvidia-smi did not answer within 1 s on local" in res.stderr and "GPUs are unknown" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"
    gpuctl("down", "-y")


class ReadCounter:
    """How many bytes of the instance's files this machine's host read (the local provider's
    LocalHost.read_bytes, counted around the real one)."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        real = LocalHost.read_bytes

        def counted(host, path, offset=0, limit=untrusted.MAX_READ):
            data = real(host, path, offset, limit)
            self.bytes += len(data or b"")
            return data

        monkeypatch.setattr(LocalHost, "read_bytes", counted)

    def during(self, action) -> int:
        before = self.bytes
        action()
        return self.bytes - before


def report_line(good: dict, epoch: int) -> bytes:
    return (json.dumps(dict(good, epoch=epoch)) + "\n").encode()


def test_a_sparse_1_gb_epochs_file_is_read_once_within_bounds_and_its_lines_after_the_hole_count(
        gpuctl, lingering_run, monkeypatch):  # noqa: F811 (the fixture imported above)
    """A hole of 1 GB (truncate: free to make) between report lines: `status` read all of it, and
    again at every look (73 s each); the line after it was glued to the hole and lost."""
    run = lingering_run
    clean_and_ok(gpuctl("status"))  # epochs 1 and 2 read
    good = json.loads(run.epochs.read_text().splitlines()[0])
    subprocess.run(["truncate", "-s", "+1G", str(run.epochs)], check=True)
    with open(run.epochs, "ab") as fh:
        fh.write(report_line(good, 3))
    reads = ReadCounter(monkeypatch)
    first = reads.during(lambda: clean_and_ok(gpuctl("status"), "epochs.jsonl", "skipped"))
    assert first <= untrusted.MAX_SCAN + MB, first
    assert reads.during(lambda: clean_and_ok(gpuctl("status"))) <= 64 << 10  # where it stopped, not again
    assert json.loads(gpuctl("cost", "--json").stdout)["runs"][0]["epochs_done"] == 3
    # Holes between lines that fit in one look: NULs end a line, and are none.
    with open(run.epochs, "ab") as fh:
        fh.write(b"\0" * (4 * MB) + report_line(good, 4) + b"\0" * 100 + report_line(good, 5)[:-1] + b"\0")
    assert reads.during(lambda: clean_and_ok(gpuctl("status"))) <= 5 * MB
    assert "ignored" not in gpuctl("status").stderr
    assert json.loads(gpuctl("cost", "--json").stdout)["runs"][0]["epochs_done"] == 5
    # 100 MB of one line without an end: skipped once, and the look after that reads nothing of it.
    with open(run.epochs, "ab") as fh:
        fh.write(b"x" * (100 * MB))
    assert reads.during(lambda: clean_and_ok(gpuctl("status"))) <= untrusted.MAX_SCAN + MB
    assert reads.during(lambda: clean_and_ok(gpuctl("status"))) <= 64 << 10
    clean_and_ok(gpuctl("down", "-y"), "is down")


def test_malformed_entries_in_the_queue_dir_are_skipped_and_named_and_runs_go_on(gpuctl, quick_project, isolated):
    """The instance's own queue (the real payload, on the local provider): one bad entry made every
    queued run fail. Each kind below is skipped and named in the run's log; the runs start."""
    gpuctl("up", "-y")
    qdir = isolated / "clusters" / "default" / "queue"
    qdir.mkdir(parents=True, exist_ok=True)
    me = os.getpid()  # a live process: an entry whose process is gone is removed, not looked at
    bad = {
        "000000000001-notjson.json": "{garbage",
        "000000000002-list.json": "[1, 2]",
        "000000000003-nokeys.json": json.dumps({"pid": me}),
        "000000000004-held.json": json.dumps({"pid": me, "seq": 4, "state": "running", "want": 1, "held": "abc"}),
        "000000000005-hugepid.json": json.dumps({"pid": 10**30, "seq": 5, "state": "queued", "want": 1}),
        "000000000006-seq.json": json.dumps({"pid": me, "seq": "6", "state": "queued", "want": 1}),
        "000000000007-\x1b]0;pwned\x07.json": json.dumps({"pid": me, "seq": 7, "state": "queued", "want": 0}),
    }
    for name, text in bad.items():
        (qdir / name).write_text(text)
    (qdir / "000000000008-dir.json").mkdir()
    first = json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["run_id"]
    second = json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["run_id"]
    gpuctl("logs", second, "-f")
    runs = {r["run_id"]: r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]}
    assert runs[first]["state"] == runs[second]["state"] == "succeeded"
    log = gpuctl("logs", first, "--raw").stdout
    for name in (*bad, "000000000008-dir.json"):
        shown = name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
        assert f"queue entry {shown} skipped" in log, (name, log)
    assert all((qdir / name).exists() for name in bad)  # named, not removed: only an entry whose run is gone is
    gpuctl("down", "-y")


@pytest.fixture
def billed_run(gpuctl, make_project, isolated, monkeypatch):
    """A local cluster at $3.60/h whose run reported two epochs and keeps running."""
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "30m")
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "1h")
    proj = make_project("billed", {"train.py": LINGERING})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    run = json.loads(gpuctl("train", proj, "--json").stdout)["run"]
    run_dir = Path(run["run_dir"])
    wait_for((run_dir / "outputs" / "pid").exists, timeout=60)
    return SimpleNamespace(run_id=run["run_id"], dir=run_dir, asked=run["started_at"])


def test_a_crafted_queue_json_cannot_move_a_runs_start_past_now_or_make_it_free(gpuctl, billed_run):
    """queue.json said the run started 89 days after it was queued, with a share of 0, rewritten
    at each look: its start moved 89 days further each time (540 days after six looks) and it was
    priced at $0 (`plan` would rank such a machine cheapest)."""
    run = billed_run
    queue_file = run.dir / "queue.json"
    queued = json.loads(queue_file.read_text())["queued_at"]
    for look in range(1, 7):
        queue_file.write_text(json.dumps({"state": "running", "queued_at": queued + (look - 1) * 89 * 86400,
                                          "started_at": queued + look * 89 * 86400, "share": 0.0, "held": [0]}))
        clean_and_ok(gpuctl("status"))
    time.sleep(1.0)
    status = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run.asked <= status["segments"][0]["started_at"] <= time.time()
    assert status["usd_per_hour"] == 3.6 and status["usd"] > 0
    cost = json.loads(gpuctl("cost", "--json").stdout)["runs"][0]
    assert cost["usd_per_hour"] == 3.6 and cost["instances_usd"] > 0
    # ... nor a start before the run was asked for, nor an end after now (the job's own `started`/`ended`).
    (run.dir / "started").write_text(f"{time.time() - 400 * 86400:.3f}\n")
    (run.dir / "ended").write_text(f"{time.time() + 400 * 86400:.3f}\n")
    gpuctl("down", "-y")
    ended = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert ended["state"] == "stopped" and ended["segments"][0]["ended_at"] <= time.time()
    assert ended["segments"][0]["started_at"] >= run.asked
