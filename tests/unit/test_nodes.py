"""The parts of multi-node runs that need no cluster: which Keras, what each node's job is given,
and how the nodes' states make the run's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuctl.model.records import InstanceRecord
from gpuctl.ops import nodes
from gpuctl.remote.local import LocalHost


def _node(tmp_path, rank, ip="127.0.0.1"):
    inst = InstanceRecord(id=f"i-{rank}", node=rank, cluster="c", state="running", private_ip=ip, launched_at=0.0,
                          workdir=str(tmp_path / str(rank)))
    return nodes.Node(rank=rank, inst=inst, host=LocalHost(tmp_path / str(rank)))


@pytest.mark.parametrize("setting,n,want", [("auto", 1, "3"), ("auto", 2, "2"), ("3", 4, "3"), ("2", 1, "2")])
def test_keras_2_by_default_on_several_nodes(setting, n, want):
    assert nodes.keras_for(setting, n) == want


def test_each_node_gets_every_address_with_its_own_index(tmp_path):
    group = [_node(tmp_path, i) for i in range(3)]
    envs = nodes.job_env(group, "2")
    workers = json.loads(envs[0]["TF_CONFIG"])["cluster"]["worker"]
    # Three workers on one address (local nodes): three different ports.
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    for i, env in enumerate(envs):
        assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        assert env["GPUCTL_NODE_RANK"] == str(i) and env["GPUCTL_NUM_NODES"] == "3"
        assert env["TF_USE_LEGACY_KERAS"] == "1"


def test_one_node_gets_no_tf_config(tmp_path):
    env, = nodes.job_env([_node(tmp_path, 0)], "3")
    assert env == {"GPUCTL_NODE_RANK": "0", "GPUCTL_NUM_NODES": "1"}


def test_a_port_the_node_answers_is_checked(tmp_path, monkeypatch):
    node = _node(tmp_path, 0)

    class Res:
        stdout = "22; rm -rf /\n"

    monkeypatch.setattr(LocalHost, "run", lambda self, argv, **kw: Res())
    with pytest.raises(Exception, match="gave no usable port"):
        nodes.free_port(node, set())


def S(rank, state, code=None, at=None):
    return nodes.NodeState(rank, state, code, at)


def test_the_run_succeeds_when_every_node_did():
    assert nodes.verdict([S(0, "succeeded", 0, 5.0), S(1, "succeeded", 0, 4.0)]) == ("succeeded", 0, None)
    # The chief done, a worker still finishing: still running.
    assert nodes.verdict([S(0, "succeeded", 0, 5.0), S(1, "running")]) == ("running", None, None)


def test_the_node_that_ended_first_decides():
    # Worker 1 was killed at t=10; the chief failed at t=14 because its peer was gone.
    seen = [S(0, "failed", 1, 14.0), S(1, "failed", 137, 10.0), S(2, "running")]
    assert nodes.verdict(seen) == ("failed", 137, 1)
    assert nodes.verdict([S(0, "running"), S(1, "lost")]) == ("lost", None, 1)
    assert nodes.verdict([S(0, "preempted", 75, 3.0), S(1, "stopped", 143, 4.0)]) == ("preempted", 75, 0)


def test_a_node_stopped_by_a_spot_notice_decides_even_after_its_peer_failed():
    # The worker heard the notice and left at a batch end; the chief's collective failed (t=12)
    # before the worker's launcher had finished leaving (t=13): the run is preempted (resumed).
    seen = [S(0, "failed", 1, 12.0), S(1, "preempted", 75, 13.0)]
    assert nodes.verdict(seen) == ("preempted", 75, 1)


def test_a_node_leaving_on_a_notice_is_waited_for_and_never_stopped(tmp_path, monkeypatch):
    # The chief failed for want of its peer; the worker heard the notice and is still saving.
    group = [_node(tmp_path, r) for r in (0, 1)]
    notice = Path(nodes.notice_file(group[1].host))
    notice.parent.mkdir(parents=True)
    notice.write_text('{"action": "terminate"}')
    seen = nodes.with_notices(group, [S(0, "failed", 1, 12.0), S(1, "running")])
    assert [n.state for n in seen] == ["failed", "leaving"]
    assert nodes.verdict(seen) == ("running", None, None)  # not failed: it decides when it ends
    # It ended, whatever its exit: its machine is going, so the run is preempted on it.
    ended = nodes.with_notices(group, [S(0, "failed", 1, 12.0), S(1, "failed", 1, 14.0)])
    assert nodes.verdict(ended) == ("preempted", 1, 1)
    # A node leaving on its notice is never stopped by gpuctl (it may be saving the checkpoint).
    stopped = []
    monkeypatch.setattr(nodes.jobs, "stop_job", lambda host, *a, **kw: stopped.append(host.root))
    run = SimpleNamespace(run_id="r", run_dir=str(tmp_path / "runs" / "r"))
    nodes.stop_rest(group, run, [S(0, "leaving"), S(1, "preempted", 75, 3.0)])
    nodes.stop_rest(group, run, [S(0, "running"), S(1, "preempted", 75, 3.0)])
    assert stopped == [group[0].host.root]


def test_a_node_whose_machine_ended_counts_as_lost_unless_the_rest_succeeded():
    from gpuctl.model.records import InstanceRecord

    gone = InstanceRecord(id="i-1", node=1, cluster="c", state="terminated", launched_at=0.0, terminated_at=9.0,
                          workdir="/w")
    assert nodes.verdict(nodes.with_gone([S(0, "failed", 1, 12.0)], gone)) == ("lost", None, 1)
    # Each node powered its machine off after its job (down_after_run): the run succeeded.
    assert nodes.verdict(nodes.with_gone([S(0, "succeeded", 0, 8.0)], gone)) == ("succeeded", 0, None)
    assert nodes.with_gone([S(0, "running")], None) == [S(0, "running")]
