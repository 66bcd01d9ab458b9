"""Nodes that share a work dir, and nodes that never start, on the sshd test
hosts. A directory on this machine's disk, outside the hosts' private /srv, is seen by both hosts
at one path: the lab's stand-in for one NFS home mounted on two lab machines.

Bad inputs tried: a shared work dir (each node gets its own subdirectory, said), a node whose
job cannot start (its queue is held: `train --wait` ends with an error naming it, exit 8, and no
job is left on any node)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests import sshd
from tests.integration.test_ssh import up_ssh

SHOW_RANK = """
import os
print("rank", os.environ["GPUCTL_NODE_RANK"], "of", os.environ["GPUCTL_NUM_NODES"], "in", os.getcwd(), flush=True)
"""
# As a MultiWorkerMirroredStrategy worker does when a peer never comes: it waits, and says nothing.
WAITS_FOR_PEERS = """
import os, time
print("rank", os.environ["GPUCTL_NODE_RANK"], "waiting for its peers", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def shared_home(ssh, monkeypatch):
    home = ssh.hosts[0].base.parent / "shared-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(home))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_nodes_that_share_a_work_dir_each_get_their_own(gpuctl, ssh, shared_home, make_project):
    h1, h2 = ssh.hosts
    err = up_ssh(gpuctl, ssh, h1, h2).stderr
    root = shared_home / "box"
    assert f"nodes 0, 1 see one work dir ({root}, a shared home?): each works in its own subdirectory, {root}/node-0" \
        in " ".join(err.split())
    assert not list(root.glob(".gpuctl-node-*"))  # the tokens are gone
    proj = make_project("ranks", {"train.py": SHOW_RANK})
    res = gpuctl("train", proj, "--allow-cpu", "--wait")
    run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    assert "Run " in res.stderr and json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"
    for rank in (0, 1):
        own = root / f"node-{rank}"
        log = (own / "runs" / run_id / "output.log").read_text()
        assert f"rank {rank} of 2 in {own}/runs/{run_id}/code" in log  # its own copy of the code
        assert f"GPUCTL_NODE_RANK={rank}" in (own / "runs" / run_id / "job.sh").read_text()
        # Each node's watchdog has a config of its own (one cluster, two tmux servers).
        assert json.loads((own / "guard" / "config.json").read_text())["tmux_socket"]
    assert not (root / "runs").exists() and not (root / "guard").exists()
    gpuctl("down", "-y")
    for h in (h1, h2):  # `down` found each node's own dir: no watchdog or job is left
        assert not h.pids(rb"gpuctl_watchdog") and not h.pids(rb"gpuctl_run")


def test_a_node_that_does_not_start_ends_the_wait_with_its_name(gpuctl, ssh, monkeypatch, make_project):
    """Node 1's job cannot start (its queue's lock is held, as by a hung process): `train --wait`
    said nothing and waited forever while node 0 waited, billed, for its peer."""
    h1, h2 = ssh.hosts
    monkeypatch.setenv("GPUCTL_TRAIN__START_TIMEOUT_S", "10")
    up_ssh(gpuctl, ssh, h1, h2)
    queue = f"{sshd.ROOT}/queue"
    h2.run(f"mkdir -p {queue} && (setsid flock {queue}/.lock sleep 300 >/dev/null 2>&1 &)")
    try:
        proj = make_project("peers", {"train.py": WAITS_FOR_PEERS})
        res = gpuctl("train", proj, "--allow-cpu", "--wait", code=8)
        run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
        assert f"Error: run {run_id} failed: node(s) 1 did not start within 10 s (stopped on every node)" in res.stderr
        assert "remote.workdir" in res.stderr and f"gpuctl logs {run_id} --node 1" in res.stderr
        assert "rank 0 waiting for its peers" in res.stdout
        run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
        assert run["state"] == "failed" and run["failed_node"] == 1
        assert run["node_states"] == ["stopped", "not started"]
        assert "nodes: 0 stopped, 1 not started" in gpuctl("status").stdout
        assert not h1.pids(rb"gpuctl_run") and not h2.pids(rb"gpuctl_queue")
    finally:
        for pid in h2.pids(rb"sleep 300"):
            sshd._run("kill", str(pid), check=False)
    gpuctl("down", "-y")


def test_nodes_that_start_are_never_timed_out(gpuctl, ssh, monkeypatch, make_project):
    """A run on two nodes that both start goes on past the deadline (it is a start deadline only)."""
    monkeypatch.setenv("GPUCTL_TRAIN__START_TIMEOUT_S", "5")
    up_ssh(gpuctl, ssh, *ssh.hosts)
    proj = make_project("slow", {"train.py": "import time\ntime.sleep(12)\nprint('slept', flush=True)\n"})
    res = gpuctl("train", proj, "--allow-cpu", "--wait")
    assert "slept" in res.stdout
    run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run["state"] == "succeeded" and run["node_states"] == ["succeeded", "succeeded"]
    assert not re.search(r"did not start", res.stderr)
    gpuctl("down", "-y")
