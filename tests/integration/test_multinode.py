"""Multi-node training on real parts: sshd hosts in their own network namespaces that reach each
other through this machine (as a cluster's nodes do on their private network), real tmux, and for
the tests about TensorFlow (marked tf: two nodes training one model, resume from the chief's
checkpoint) real TensorFlow on CPU running the unmodified MultiWorkerMirroredStrategy script of
examples/multiworker. What gpuctl does around the nodes (their TF_CONFIG, a killed worker, a start
that fails, status while they start) runs plain-Python jobs: the same gpuctl path in seconds.

Bad inputs tried: `--nodes 3` with two --host (ssh), `--nodes 0`, `train --budget` on several
nodes, `logs --node 5` of a two-node run, `logs --node 1 --guard`, `train.keras = "4"`, a node whose
Python lacks tf_keras. Each exits non-zero with one line and a hint, and starts nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests import sshd
from tests.conftest import REPO, SshLab, use_hosts
from tests.integration.test_ssh import up_ssh
from tests.waits import wait_for

EXAMPLE = REPO / "examples" / "multiworker"
# Prints what gpuctl gave the job (no TensorFlow: a second, not a minute).
SHOW_ENV = """
import json, os
keys = ("TF_CONFIG", "GPUCTL_NODE_RANK", "GPUCTL_NUM_NODES", "TF_USE_LEGACY_KERAS")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""
# Every node works through `--epochs` epochs of `--epoch-seconds` (arguments as the example's); the
# chief reports each, as examples/multiworker's chief does. No TensorFlow: what gpuctl does with the
# nodes' jobs is the same.
NODE_EPOCHS = SHOW_ENV + """
import os, sys, time
import gpuctl_report

def arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default

rank, n = int(os.environ["GPUCTL_NODE_RANK"]), os.environ["GPUCTL_NUM_NODES"]
print("worker %d of %s" % (rank, n), flush=True)
ckpt = os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "checkpoint")  # as the launcher's Keras hook makes it
os.makedirs(ckpt, exist_ok=True)
open(os.path.join(ckpt, "node-%d" % rank), "w").write("epoch 0\\n")
cfg = gpuctl_report.run_config()
writer = gpuctl_report.ReportWriter.shared(cfg["report_path"], cfg["run_id"], cfg["usd_per_hour"]) if rank == 0 else None
epochs = arg("--epochs", 3)
for _ in range(epochs):
    start = time.time()
    time.sleep(arg("--epoch-seconds", 0.2))
    if writer:
        writer.write(start, time.time(), 100, False, epochs, {"loss": 0.5})
print("done", flush=True)
"""
SLEEPER = "import time\nprint('working', flush=True)\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def node_lab(forwarding):
    """Three sshd hosts that reach each other (through this machine: `forwarding`)."""
    with sshd.running_lab("node-hosts", {5: "n5", 6: "n6", 7: "n7"}) as (key, hosts):
        yield SshLab(key, hosts)


@pytest.fixture
def nodes(node_lab, monkeypatch):
    use_hosts(node_lab.hosts, monkeypatch)
    return node_lab


def _status(gpuctl, run_id):
    return next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)


def _run_id(res) -> str:
    return re.search(r"Run (\S+) (?:started|succeeded|failed)", res.stdout + res.stderr).group(1)


def _checksums(gpuctl, run_id, n):
    sums = []
    for node in range(n):
        log = gpuctl("logs", run_id, "--node", str(node)).stdout
        assert f"worker {node} of {n}" in log, log[-2000:]
        sums.append(re.search(r"weights checksum: (\w+)", log).group(1))
    return sums


@pytest.mark.tf
def test_two_nodes_train_one_model_and_bill_both(gpuctl, nodes):
    h1, h2 = nodes.hosts[:2]
    up_ssh(gpuctl, nodes, h1, h2, extra=("--usd-per-hour", "1.8"))
    res = gpuctl("train", EXAMPLE, "--allow-cpu", "--wait", "--", "--epochs", "3")
    run_id = _run_id(res)
    assert "succeeded" in res.stdout + res.stderr
    # One model: every worker ends with the same weights.
    a, b = _checksums(gpuctl, run_id, 2)
    assert a == b
    run = _status(gpuctl, run_id)
    assert run["state"] == "succeeded" and run["node_states"] == ["succeeded", "succeeded"]
    # The chief's reports only: one row per epoch; examples count both nodes' shares (the global
    # batch); each epoch billed at the sum of the nodes' rates.
    cost = json.loads(gpuctl("cost", run_id, "--json").stdout)["runs"][0]
    epochs = cost["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3] and cost["usd_per_hour"] == pytest.approx(3.6)
    for e in epochs:
        assert e["epoch_cost_usd"] == pytest.approx(e["seconds"] * 3.6 / 3600, rel=1e-6)
        assert e["examples"] == 1797  # scikit-learn's digits, all of them, though each node saw half
    assert "nodes: 0 succeeded, 1 succeeded" in gpuctl("status").stdout
    gpuctl("down", "-y")
    for h in (h1, h2):
        assert not h.pids(rb"gpuctl_run"), "a node still runs the job after down"


def test_three_nodes_get_tf_config_and_agree(gpuctl, nodes, make_project):
    up_ssh(gpuctl, nodes, *nodes.hosts)
    # What each node's job is given: every node's address (private network) with a port, its index.
    proj = make_project("env", {"train.py": SHOW_ENV})
    run_id = _run_id(gpuctl("train", proj, "--allow-cpu", "--wait"))
    seen = []
    for node in range(3):
        env = json.loads(re.search(r"ENV (.*)", gpuctl("logs", run_id, "--node", str(node)).stdout).group(1))
        seen.append(env)
        cfg = json.loads(env["TF_CONFIG"])
        assert cfg["task"] == {"type": "worker", "index": node}
        assert env["GPUCTL_NODE_RANK"] == str(node) and env["GPUCTL_NUM_NODES"] == "3"
        assert env["TF_USE_LEGACY_KERAS"] == "1"  # Keras 2 by default on several nodes
    workers = json.loads(seen[0]["TF_CONFIG"])["cluster"]["worker"]
    assert [w.rsplit(":", 1)[0] for w in workers] == [h.ip for h in nodes.hosts]
    assert all(json.loads(e["TF_CONFIG"])["cluster"]["worker"] == workers for e in seen)
    # Three nodes work through their epochs; the chief's reports are the run's.
    run_id = _run_id(gpuctl("train", make_project("epochs", {"train.py": NODE_EPOCHS}), "--allow-cpu", "--wait",
                            "--", "--epochs", "2"))
    for node in range(3):
        assert "worker %d of 3" % node in gpuctl("logs", run_id, "--node", str(node)).stdout
    assert [e["epoch"] for e in json.loads(gpuctl("cost", run_id, "--json").stdout)["runs"][0]["epochs"]] == [1, 2]


def test_a_killed_worker_stops_every_node_and_is_named(gpuctl, nodes, make_project):
    h1, h2 = nodes.hosts[:2]
    up_ssh(gpuctl, nodes, h1, h2)
    killed = []

    def kill_worker_after_epoch_1():
        # From beside `train --wait`: the chief's first report, then SIGKILL to node 1's job.
        try:
            wait_for(lambda: h1.run("cat /srv/gpuctl/box/runs/*/epochs.jsonl 2>/dev/null").stdout.strip(), 120)
        except AssertionError:
            return
        for pid in h2.pids(rb"gpuctl_run"):
            sshd._run("kill", "-9", str(pid))
            killed.append(pid)

    killer = threading.Thread(target=kill_worker_after_epoch_1)
    killer.start()
    proj = make_project("epochs", {"train.py": NODE_EPOCHS})
    res = gpuctl("train", proj, "--allow-cpu", "--wait", "--", "--epochs", "300", "--epoch-seconds", "0.5", code=8)
    killer.join()
    assert killed, "node 1's job was never seen"
    run_id = _run_id(res)
    # Named, with that node's last lines (only the chief's log was streamed).
    assert f"run {run_id} failed on node 1 (exit code 137)" in res.stderr
    assert "== last lines of node 1's log" in res.stderr and f"gpuctl logs {run_id} --node 1" in res.stderr
    run = _status(gpuctl, run_id)
    assert run["state"] == "failed" and run["failed_node"] == 1 and run["exit_code"] == 137
    assert run["node_states"][1] == "failed" and run["node_states"][0] in ("stopped", "failed")
    assert f"{run_id} failed on node 1; last lines of its log there" in gpuctl("status").stdout
    wait_for(lambda: not h1.pids(rb"gpuctl_run") and not h2.pids(rb"gpuctl_run"), 10, "every node's job gone")


@pytest.mark.tf
def test_resume_restores_every_node_from_the_chiefs_checkpoint(gpuctl, nodes):
    h1, h2 = nodes.hosts[:2]
    up_ssh(gpuctl, nodes, h1, h2)
    run_id = _run_id(gpuctl("train", EXAMPLE, "--allow-cpu", "--", "--epochs", "5", "--epoch-seconds", "1.5"))
    wait_for(lambda: _status(gpuctl, run_id)["epoch"] >= 2, 120, "epoch 2")
    for pid in h1.pids(rb"gpuctl_run"):  # the chief goes; node 1 follows (TensorFlow, or gpuctl)
        sshd._run("kill", "-9", str(pid))
    wait_for(lambda: _status(gpuctl, run_id)["state"] != "running", 120, "the killed run's end")
    done = _status(gpuctl, run_id)["epoch"]
    out = gpuctl("train", "--resume", run_id, "--wait")
    assert "the chief's checkpoint" in out.stdout + out.stderr
    run = _status(gpuctl, run_id)
    assert run["state"] == "succeeded"
    epochs = [e["epoch"] for e in json.loads(gpuctl("cost", run_id, "--json").stdout)["runs"][0]["epochs"]]
    assert epochs == [1, 2, 3, 4, 5] and done >= 2
    a, b = _checksums(gpuctl, run_id, 2)
    assert a == b
    # Both restarted from epoch `done`, not from scratch: each log says where Keras began again.
    for node in (0, 1):
        log = gpuctl("logs", run_id, "--node", str(node)).stdout
        # The resumed attempt is what follows the script's last "worker I of N" line (TensorFlow's
        # own errors at shutdown name /job:worker too, so a bare "worker" is no marker).
        starts = [m.end() for m in re.finditer(r"^worker \d+ of \d+$", log, re.M)]
        assert starts, log[-2000:]
        last = log[starts[-1] :]
        assert f"Epoch {done + 1}/5" in last
        assert "Epoch 1/5" not in last


def test_bad_inputs_start_nothing(gpuctl, nodes, node_lab, monkeypatch, make_project):
    h1, h2 = nodes.hosts[:2]
    err = up_ssh(gpuctl, nodes, h1, h2, code=3, extra=("--nodes", "3")).stderr
    assert "--nodes 3 with 2 --host" in err and "Hint:" in err
    assert "Error" in gpuctl("up", "--nodes", "0", code=2).stderr
    up_ssh(gpuctl, nodes, h1, h2)
    err = gpuctl("train", EXAMPLE, "--allow-cpu", "--budget", "1", code=3).stderr
    assert "run budget" in err and "gpuctl guard set --budget" in err
    monkeypatch.setenv("GPUCTL_TRAIN__KERAS", "4")
    assert "train.keras" in gpuctl("train", EXAMPLE, "--allow-cpu", code=3).stderr
    monkeypatch.delenv("GPUCTL_TRAIN__KERAS")
    # A node whose Python has no tf_keras (hidden in that host's own mount namespace).
    site = Path(REPO / ".venv" / "lib").glob("python3*/site-packages")
    site = next(iter(site))
    h2.run(f"for d in {site}/tf_keras {site}/tf_keras-*.dist-info; do mount -t tmpfs tmpfs $d; done")
    try:
        err = gpuctl("train", EXAMPLE, "--allow-cpu", code=7).stderr
    finally:
        h2.run(f"for d in {site}/tf_keras {site}/tf_keras-*.dist-info; do umount $d; done")
    assert "node 1" in err and "tf_keras is not installed" in err and "keras = \"3\"" in err
    assert not h1.pids(rb"gpuctl_run") and not h2.pids(rb"gpuctl_run")
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []
    run_id = _run_id(gpuctl("train", make_project("env", {"train.py": SHOW_ENV}), "--allow-cpu", "--wait"))
    err = gpuctl("logs", run_id, "--node", "5", code=4).stderr
    assert "has no node 5" in err and "--node 0 to 1" in err
    assert "--node" in gpuctl("logs", "--node", "1", "--guard", code=2).stderr


def test_local_nodes_are_workers_on_this_machine(gpuctl, tmp_path, make_project):
    gpuctl("up", "--provider", "local", "--nodes", "2", "--usd-per-hour", "1.5", "-y")
    res = gpuctl("train", make_project("epochs", {"train.py": NODE_EPOCHS}), "--allow-cpu", "--wait", "--",
                 "--epochs", "2")
    run_id = _run_id(res)
    workers = []
    for node in range(2):
        log = gpuctl("logs", run_id, "--node", str(node)).stdout
        assert f"worker {node} of 2" in log
        cfg = json.loads(json.loads(re.search(r"ENV (.*)", log).group(1))["TF_CONFIG"])
        assert cfg["task"]["index"] == node
        workers.append(cfg["cluster"]["worker"])
    # Both on this machine, each on a port of its own (what MultiWorkerMirroredStrategy needs).
    assert workers[0] == workers[1] and len(set(workers[0])) == 2
    assert all(w.startswith(("127.0.0.1:", "localhost:")) for w in workers[0]), workers
    root = tmp_path / "gpuctl-home" / "clusters" / "default"
    # Each node's watchdog counts the whole cluster's spend against the budget: $3/h, not $1.5/h.
    for node_root in (root, root / "nodes" / "1"):
        assert json.loads((node_root / "guard" / "config.json").read_text())["usd_per_hour"] == 3.0
    dirs = [root / "runs" / run_id, root / "nodes" / "1" / "runs" / run_id]
    assert all((d / "outputs" / "checkpoint").is_dir() for d in dirs)
    gpuctl("runs", "rm", run_id, "-y")  # every node's copy
    assert not any(d.exists() for d in dirs)
    out = gpuctl("down", "-y")
    assert "nodes/1" in out.stdout + out.stderr
    assert not (tmp_path / "gpuctl-home" / "clusters" / "default").exists()
    # Its rate stays the cluster's after down (it showed one node's).
    cluster, = json.loads(gpuctl("status", "--json").stdout)["clusters"]
    assert cluster["usd_per_hour"] == 3.0
    # A placement group is EC2's: refused on local, nothing made.
    assert "--placement cluster is for aws clusters" in gpuctl("up", "--provider", "local", "--nodes", "2",
                                                               "--placement", "cluster", "--name", "pl", code=3).stderr
    assert not (tmp_path / "gpuctl-home" / "clusters" / "pl").exists()


def test_keras_3_on_several_nodes_is_the_users_call_with_a_warning(gpuctl, make_project, monkeypatch):
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", "k3")
    monkeypatch.setenv("GPUCTL_TRAIN__KERAS", "3")
    res = gpuctl("train", make_project("env", {"train.py": SHOW_ENV}), "--wait")
    assert "Keras 3's fit fails under MultiWorkerMirroredStrategy" in res.stderr
    env = json.loads(re.search(r"ENV (.*)", res.stdout + res.stderr).group(1))
    assert env["TF_USE_LEGACY_KERAS"] is None and json.loads(env["TF_CONFIG"])["task"]["index"] == 0


def _local_two(gpuctl, name="two"):
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", name)


def test_a_start_that_fails_on_one_node_stops_every_node(gpuctl, monkeypatch, make_project):
    """Node 1's job starts, then its connection drops (simulated: start_job raises after tmux has
    it): the run is failed and no node is left running it, billed."""
    from gpuctl.errors import RemoteError
    from gpuctl.remote import jobs

    _local_two(gpuctl)
    real = jobs.start_job

    def start_then_drop(host, session, *args, **kw):
        real(host, session, *args, **kw)
        if host.root.endswith("/nodes/1"):
            raise RemoteError("connection to node 1 lost", "simulated")

    monkeypatch.setattr(jobs, "start_job", start_then_drop)
    _fails_leaving_nothing(gpuctl, make_project, "connection to node 1 lost")


def _fails_leaving_nothing(gpuctl, make_project, error: str) -> None:
    """A train whose start fails as `error` says: the run failed, and no node left running it, billed
    (its command line names the run: its run.json is under the run's dir)."""
    err = gpuctl("train", make_project("sleeper", {"train.py": SLEEPER}), code=7).stderr
    assert error in err
    run, = json.loads(gpuctl("status", "--json").stdout)["runs"]
    assert run["state"] == "failed"
    ps = subprocess.run(["pgrep", "-f", run["run_id"]], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "a node still runs the failed run"


def test_the_nodes_start_at_once(gpuctl, monkeypatch, make_project):
    """Each node's start waits, in the test, until the other's has begun: one after the other,
    the first would wait for the second in vain (and the train fail)."""
    from gpuctl.remote import jobs

    _local_two(gpuctl)
    real, both = jobs.start_job, threading.Barrier(2, timeout=10)

    def start_together(host, session, *args, **kw):
        both.wait()
        real(host, session, *args, **kw)

    monkeypatch.setattr(jobs, "start_job", start_together)
    run_id = _run_id(gpuctl("train", make_project("env", {"train.py": SHOW_ENV}), "--wait"))
    assert _status(gpuctl, run_id)["state"] == "succeeded"


def test_a_chief_whose_start_fails_while_a_worker_starts_leaves_nothing_running(gpuctl, monkeypatch, make_project):
    """Started at once, node 1's job may be up when node 0's start fails: it is stopped too, the run
    failed, and the error is node 0's."""
    from gpuctl.errors import RemoteError
    from gpuctl.remote import jobs

    _local_two(gpuctl)
    real, worker_started = jobs.start_job, threading.Event()

    def chief_fails(host, session, *args, **kw):
        if host.root.endswith("/nodes/1"):
            real(host, session, *args, **kw)
            worker_started.set()
            return
        assert worker_started.wait(10)
        raise RemoteError("connection to node 0 lost", "simulated")

    monkeypatch.setattr(jobs, "start_job", chief_fails)
    _fails_leaving_nothing(gpuctl, make_project, "connection to node 0 lost")


def test_status_while_nodes_start_leaves_the_run_alone(gpuctl, make_project):
    """A look while the jobs start node after node takes a node not started yet for no lost node
    (it used to stop the chief that had started)."""
    from gpuctl.ops.session import open_session

    _local_two(gpuctl)
    run_id = _run_id(gpuctl("train", make_project("env", {"train.py": SHOW_ENV}), "--wait"))
    s = open_session()
    try:
        run = s.find_run(run_id)
        s.ledger.put_run(run.model_copy(update={"run_id": "half-started", "state": "starting",
                                                "started_at": time.time(), "ended_at": None}))
    finally:
        s.close()
    assert _status(gpuctl, "half-started")["state"] == "starting"


def test_resume_elsewhere_needs_as_many_nodes(gpuctl, make_project):
    """A two-node run's checkpoint (Keras 2) would not be read by one node (Keras 3): refused
    before anything moves, instead of a run that starts over as if resumed."""
    from gpuctl.ops.session import open_session

    _local_two(gpuctl)
    run_id = _run_id(gpuctl("train", make_project("env", {"train.py": SHOW_ENV}), "--wait"))
    gpuctl("up", "--provider", "local", "--name", "one")
    s = open_session()
    try:
        s.ledger.put_run(s.find_run(run_id).model_copy(update={"state": "failed", "exit_code": 1}))
    finally:
        s.close()
    err = gpuctl("train", "--resume", run_id, "--cluster", "one", code=5).stderr
    assert "ran on 2 node(s); cluster 'one' has 1" in err and "up --nodes 2" in err
    assert "half" not in err and _status(gpuctl, run_id)["state"] == "failed"
