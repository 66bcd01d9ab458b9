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


def test_the_nodes_that_heard_a_spot_notice_are_read_from_their_watchdogs_file(tmp_path):
    group = [_node(tmp_path, r) for r in (0, 1)]
    assert nodes.notices(group) == set()
    notice = Path(nodes.notice_file(group[1].host))
    notice.parent.mkdir(parents=True)
    notice.write_text('{"action": "terminate"}')
    assert nodes.notices(group) == {1}


def test_stop_rest_stops_the_ranks_it_is_given_and_no_other(tmp_path, monkeypatch):
    group = [_node(tmp_path, r) for r in (0, 1, 2)]
    stopped = []
    monkeypatch.setattr(nodes.jobs, "stop_job", lambda host, *a, **kw: stopped.append(host.root))
    run = SimpleNamespace(run_id="r", run_dir=str(tmp_path / "runs" / "r"))
    assert nodes.stop_rest(group, run, (0, 2)) == set()
    assert sorted(stopped) == sorted([group[0].host.root, group[2].host.root])
