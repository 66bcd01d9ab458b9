"""The cluster's run queue, on the local provider with real tmux and on an sshd
host: runs wait for their GPUs on the instance, in order; `status` shows their place; `--now`
starts beside; a run pays its share of the node (GPUs held / the node's GPUs).

The job scripts are plain Python that wait on barrier files (no TensorFlow, no sleeping for a
set time): a run writes `started-<tag>` in a shared folder and runs until `go-<tag>` exists.

Bad inputs tried: `--gpus 3` on a node with 2 GPUs and `--gpus 2` on a node without GPU (one
slot), `--gpus 0` (each one line, nothing started), `--gpus` with `--resume`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.test_guards import fired, wait_for
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT

BARRIER = '''
import os, sys, time
tag, gate = sys.argv[1], sys.argv[2]
os.makedirs(gate, exist_ok=True)
with open(os.path.join(gate, "started-" + tag), "w") as fh:
    fh.write(os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
while not os.path.exists(os.path.join(gate, "go-" + tag)):
    time.sleep(0.05)
print("done", tag, flush=True)
'''


@pytest.fixture
def barrier(make_project, tmp_path):
    return make_project("barrier", {"train.py": BARRIER}), tmp_path / "gate"


def started(gate: Path) -> set[str]:
    return {p.name[len("started-"):] for p in gate.glob("started-*")} if gate.exists() else set()


def run_ids(gpuctl) -> list[str]:
    return [r["run_id"] for r in json.loads(gpuctl("status", "--json").stdout)["runs"]]


def states(gpuctl) -> dict[str, dict]:
    return {r["run_id"]: r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]}


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """A node with two GPUs: nvidia-smi on PATH listing two. No GPU can exist on these test machines,
    so this stand-in is the one mock; the queue only counts nvidia-smi's lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in *-L*) echo "GPU 0: Fake (UUID: a)"; echo "GPU 1: Fake (UUID: b)";;'
                    ' *) echo 0; echo 0;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_three_trains_run_one_at_a_time_in_order_and_status_shows_their_place(gpuctl, barrier):
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    outs = [gpuctl("train", proj, "--", tag, gate).stdout for tag in ("a", "b", "c")]
    assert "started on" in outs[0]
    assert "queued on" in outs[1] and "1st in line" in outs[1]
    assert "queued on" in outs[2] and "2nd in line" in outs[2]
    a, b, c = run_ids(gpuctl)
    wait_for(lambda: started(gate) == {"a"})
    table = gpuctl("status").stdout
    assert "queued (1st)" in table and "queued (2nd)" in table
    st = states(gpuctl)
    assert (st[a]["state"], st[b]["state"], st[c]["state"]) == ("running", "queued", "queued")
    assert st[b]["usd"] == 0.0 and st[c]["queue_position"] == 2
    (gate / "go-a").touch()
    wait_for(lambda: started(gate) == {"a", "b"})
    # c's waiting process rewrites its place when it next looks: a moment after b starts, not with it.
    st = wait_for(lambda: (lambda s: s if s[b]["state"] == "running" and s[c]["queue_position"] == 1 else None)(
        states(gpuctl)))
    assert st[a]["state"] == "succeeded" and st[c]["state"] == "queued"
    (gate / "go-b").touch()
    wait_for(lambda: started(gate) == {"a", "b", "c"})
    (gate / "go-c").touch()
    gpuctl("logs", c, "-f")
    st = states(gpuctl)
    assert {r["state"] for r in st.values()} == {"succeeded"}
    # One at a time: the runs' stretches never overlap, and together they cost no more than the cluster.
    spans = sorted((r["segments"][0]["started_at"], r["segments"][0]["ended_at"]) for r in st.values())
    assert all(prev[1] <= nxt[0] + 0.5 for prev, nxt in zip(spans, spans[1:]))
    cluster = json.loads(gpuctl("status", "--json").stdout)["clusters"][0]
    assert sum(r["usd"] for r in st.values()) <= cluster["usd"] + 1e-9


def test_now_starts_beside_and_a_run_without_gpu_then_holds_none(gpuctl, barrier):
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", "a", gate)
    out = gpuctl("train", proj, "--now", "--", "b", gate).stdout
    assert "beside the runs already there (--now)" in out
    wait_for(lambda: started(gate) == {"a", "b"})
    a, b = run_ids(gpuctl)
    st = wait_for(lambda: (lambda s: s if s[b]["usd_per_hour"] == 0.0 else None)(states(gpuctl)))
    # The node's one slot is a's: b runs on it beside a and pays nothing; a pays the node's rate.
    assert st[a]["usd_per_hour"] == 3.6 and st[b]["state"] == "running"
    (gate / "go-a").touch()
    (gate / "go-b").touch()
    gpuctl("logs", b, "-f")


def test_gpus_share_a_node_each_paying_its_part(gpuctl, barrier, two_gpus):
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--gpus", "1", "--", "a", gate)
    out = gpuctl("train", proj, "--gpus", "1", "--", "b", gate).stdout
    assert "started on" in out  # a second GPU was free
    third = gpuctl("train", proj, "--", "c", gate).stdout  # all of the node: waits for both
    assert "queued on" in third
    wait_for(lambda: started(gate) == {"a", "b"})
    assert sorted((gate / f"started-{t}").read_text() for t in "ab") == ["0", "1"]
    a, b, c = run_ids(gpuctl)
    st = wait_for(lambda: (lambda s: s if s[b]["usd_per_hour"] == 1.8 and s[a]["usd_per_hour"] == 1.8
                           else None)(states(gpuctl)))
    assert st[c]["state"] == "queued"
    (gate / "go-a").touch()
    (gate / "go-b").touch()
    wait_for(lambda: "c" in started(gate))
    assert (gate / "started-c").read_text() == "0,1"
    (gate / "go-c").touch()
    gpuctl("logs", c, "-f")
    assert states(gpuctl)[c]["usd_per_hour"] == 3.6


def test_gpus_bigger_than_the_node_is_refused_and_nothing_starts(gpuctl, barrier, two_gpus):
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    res = gpuctl("train", proj, "--gpus", "3", "--", "a", gate, code=3)
    assert res.stderr.startswith("Error: --gpus 3: the node has 2 GPU(s)") and "Hint:" in res.stderr
    res = gpuctl("train", proj, "--gpus", "0", "--", "a", gate, code=3)
    assert "at least one GPU" in res.stderr
    assert run_ids(gpuctl) == []


def test_down_and_dequeue_remove_queued_runs_before_they_start(gpuctl, barrier):
    from gpuctl.ops import queue
    from gpuctl.ops.session import open_session

    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    for tag in "abc":
        gpuctl("train", proj, "--", tag, gate)
    a, b, c = run_ids(gpuctl)
    wait_for(lambda: started(gate) == {"a"})
    s = open_session()
    try:
        record = s.resolve_cluster(None)
        host = s.hosts(record)[0][1]
        assert queue.dequeue(host, c) and not queue.dequeue(host, a)
    finally:
        s.close()
    st = wait_for(lambda: (lambda s: s if s[c]["state"] == "stopped" else None)(states(gpuctl)))
    assert st[c]["usd"] == pytest.approx(0.0, abs=1e-3)
    gpuctl("down", "-y")
    assert started(gate) == {"a"}  # b, queued behind a, never started while the cluster went down
    st = states(gpuctl)
    assert st[a]["state"] == "stopped" and st[b]["state"] == "stopped"


def test_gpuctl_stop_of_a_queued_run_takes_it_out_before_it_starts(gpuctl, barrier):
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    for tag in "ab":
        gpuctl("train", proj, "--", tag, gate)
    a, b = run_ids(gpuctl)
    wait_for(lambda: started(gate) == {"a"})
    assert states(gpuctl)[b]["state"] == "queued"
    out = gpuctl("stop", b).stdout
    assert b in out
    st = states(gpuctl)
    assert st[b]["state"] == "stopped" and st[a]["state"] == "running"
    gpuctl("stop", a)
    assert started(gate) == {"a"}  # b never started, not even once a stopped and freed the node
    gpuctl("down", "-y")


def test_a_queued_run_is_said_alike_everywhere_and_its_stop_says_it_never_started(gpuctl, barrier):
    """On a node without GPU (this machine) the queue is one slot, and says so; its log line, `status`
    and `train` give one place ("1st"); `stop` of a queued run says it left the queue (it said
    SIGTERM/SIGKILL, exit 143 and `--resume` for a run that never started)."""
    proj, gate = barrier
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", "a", gate)
    out = gpuctl("train", proj, "--", "b", gate).stdout
    a, b = run_ids(gpuctl)
    assert "(1st in line)" in out and "GPU(s)" not in out and "the node's one slot is free (no GPU there" in out
    wait_for(lambda: started(gate) == {"a"})
    assert "queued (1st)" in gpuctl("status").stdout
    log = wait_for(lambda: (lambda t: t if "queued" in t else None)(gpuctl("logs", b).stdout))
    assert "gpuctl: queued (1st): waiting for the node's one slot (no GPU there" in log and "GPU(s)" not in log
    out = gpuctl("stop", b).stdout
    assert f"Took run {b} out of cluster 'default''s queue before it started" in out
    said = out.replace(b, "<run>")  # the run id's random suffix may hold "143" itself
    assert "--resume" not in said and "SIGKILL" not in said and "143" not in said
    out = json.loads(gpuctl("stop", a, "--json").stdout)
    assert out["dequeued"] == [] and out["stopped"][0]["run_id"] == a
    gpuctl("down", "-y")


def test_queued_runs_keep_the_idle_guard_from_firing_on_an_ssh_host(gpuctl, fast_guards, barrier):
    """Queued runs are work: with idle at 3 s the instance stays up while b waits behind a."""
    host = fast_guards.hosts[0]
    up_ssh(gpuctl, fast_guards)
    proj = barrier[0]
    gate = f"{ROOT}/gate"
    gpuctl("train", proj, "--allow-cpu", "--", "a", gate)
    out = gpuctl("train", proj, "--allow-cpu", "--", "b", gate).stdout
    assert "queued on" in out
    a, b = run_ids(gpuctl)
    wait_for(lambda: host.run(f"test -e {gate}/started-a").returncode == 0, timeout=120)
    # Several idle limits pass; the watchdog sees b queued, and neither fires nor calls it stalled.
    state = wait_for(lambda: (lambda st: st if st.get("queued") == [b] else None)(
        json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout or "{}")), timeout=30)
    first = state["at"]
    wait_for(lambda: json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout or "{}").get("at", 0) > first + 6)
    assert fired(host) is None
    host.run(f"touch {gate}/go-a")
    wait_for(lambda: host.run(f"test -e {gate}/started-b").returncode == 0, timeout=60)
    host.run(f"touch {gate}/go-b")
    gpuctl("logs", b, "-f")
    assert states(gpuctl)[b]["state"] == "succeeded"


CHATTY = '''
import os, sys, time
tag, gate = sys.argv[1], sys.argv[2]
os.makedirs(gate, exist_ok=True)
open(os.path.join(gate, "started-" + tag), "w").close()
while not os.path.exists(os.path.join(gate, "go-" + tag)):
    print(".", flush=True)  # its log grows: it is not stalled
    time.sleep(0.2)
'''


@pytest.mark.slow  # a real stall limit passes (~20 s)
def test_a_queued_run_is_work_and_never_stalled(gpuctl, make_project, tmp_path, monkeypatch):
    """With a stall limit of 15 s that fires (longer than the launcher's TensorFlow import, silent in
    the running run's log): a queued run's log stays silent (it has not started),
    yet the watchdog neither calls it stalled nor stops it."""
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "3s", "STALL": "15s", "ON_STALL": "fire"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    proj, gate = make_project("chatty", {"train.py": CHATTY}), tmp_path / "gate"
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", "a", gate)
    gpuctl("train", proj, "--", "b", gate)
    a, b = run_ids(gpuctl)
    guard_dir = Path(os.environ["GPUCTL_HOME"]) / "clusters" / "default" / "guard"

    def look() -> dict:
        try:
            return json.loads((guard_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    first = wait_for(lambda: (lambda st: st if st.get("queued") == [b] else None)(look()))["at"]
    seen = wait_for(lambda: (lambda st: st if st.get("at", 0) > first + 20 else None)(look()),
                    timeout=60)
    assert seen["stalled"] == [] and not (guard_dir / "fired.json").exists()
    assert states(gpuctl)[b]["state"] == "queued"
    (gate / "go-a").touch()
    (gate / "go-b").touch()
    gpuctl("logs", b, "-f")
    assert states(gpuctl)[b]["state"] == "succeeded"
