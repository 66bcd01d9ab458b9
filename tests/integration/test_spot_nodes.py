"""Spot recovery of a two-node run, end to end on real parts: a moto server (EC2 and S3), four sshd
test hosts reaching each other through this machine (the two nodes, then their two replacements:
the seam maps node N's instance to a host by its address, any later one by its rank), the fake
IMDSv2 (the notice for the worker's host alone), and real TensorFlow running examples/multiworker
unmodified under MultiWorkerMirroredStrategy.

The worker (node 1) hears the notice during epoch 3: it leaves at a batch end and its peer, the
chief, fails without it. The run is preempted on node 1 (not failed); `train --wait` ends the
chief's machine at once (EC2 is not taking it: waiting would only bill it), gives EC2 the worker's,
launches two nodes, and both restore the chief's checkpoint from S3 and finish the run: every epoch
once, one model (the same weights on both nodes), both nodes' instances in the run's segments.
"""

from __future__ import annotations

import json
import re

import pytest

from tests import sshd
from tests.aws import live_instances
from tests.conftest import use_hosts
from tests.integration.test_aws_nodes import by_rank
from tests.integration.test_multinode import EXAMPLE, _checksums
from tests.integration.test_spot_notice import spot_terminate, wait_for
from tests.integration.test_spot_recovery import finished, run_id_on, spot_world, stored_keys, train_in_background

pytestmark = pytest.mark.tf


@pytest.fixture
def four_hosts(aws, ssh, imds, moto_server, isolated, monkeypatch, forwarding):
    """(first pair, replacement pair): two hosts of their own for the first nodes, the session's two
    for the replacements; each pair's nodes reach each other through this machine (`forwarding`)."""
    with sshd.running_lab("spot-node-hosts", {8: "s8", 9: "s9"}) as (_, first):
        use_hosts(first, monkeypatch)
        with spot_world(monkeypatch, imds, moto_server, isolated, (*first, *ssh.hosts)):
            monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"node:0={first[0].ip},node:1={first[1].ip}")
            yield first, ssh.hosts


def test_a_worker_interrupted_mid_run_is_replaced_with_its_chief_and_the_run_finishes(gpuctl, aws, four_hosts, imds,
                                                                                     monkeypatch):
    (a0, a1), (b0, b1) = four_hosts
    gpuctl("up", "--nodes", "2", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
    chief, worker = by_rank(live_instances(aws))
    # These two stay on the first pair (by address); any later node N is the second pair's host N.
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"node:0={b0.ip},node:1={b1.ip},"
                                                f"{chief['PublicIpAddress']}={a0.ip},{worker['PublicIpAddress']}={a1.ip}")
    thread, out = train_in_background(gpuctl, ("train", EXAMPLE, "--allow-cpu", "--wait", "--",
                                               "--epochs", "8", "--epoch-seconds", "3"))
    run_id = run_id_on(a0, out)
    wait_for("epoch 2 in S3", lambda: "epochs.jsonl" in stored_keys(aws, run_id)
             and len(a0.run(f"cat /srv/gpuctl/runs/{run_id}/epochs.jsonl").stdout.splitlines()) >= 2, timeout=240)
    imds.interrupt(a1)  # the worker's host alone
    code = wait_for("the worker's exit", lambda: a1.run(f"cat /srv/gpuctl/runs/{run_id}/exitcode 2>/dev/null")
                    .stdout.strip(), timeout=60)
    assert code == "75", a1.run(f"tail -n 30 /srv/gpuctl/guard/*.log /srv/gpuctl/runs/{run_id}/output.log").stdout
    spot_terminate(worker["InstanceId"])  # EC2, a while after its notice
    a1.stop()
    res = finished(thread, out, 400)
    err = res.stderr
    # EC2 was given the worker's machine only (if it had not ended it already); the chief's,
    # which EC2 was not taking, gpuctl ended at once, before any wait.
    assert not re.search(rf"letting EC2 end [^\n]*{chief['InstanceId']}", err)
    terminated = err.index(f"terminating {chief['InstanceId']}")
    assert "letting EC2 end" not in err[:terminated]
    assert f"run {run_id} resumed on i-" in err and f"Run {run_id} succeeded" in res.stdout + err

    new_chief, new_worker = by_rank(live_instances(aws))
    assert {new_chief["InstanceId"], new_worker["InstanceId"]}.isdisjoint({chief["InstanceId"], worker["InstanceId"]})
    # Both replacements restored the chief's checkpoint from S3 (nothing of it was on their disks).
    for node in (0, 1):
        log = gpuctl("logs", run_id, "--node", str(node)).stdout
        assert "restored the run's checkpoint and reports from the store" in log, log[-2000:]
        assert "Epoch 1/8" not in log.split("restored the run's checkpoint")[1]  # went on, not over
    a, b = _checksums(gpuctl, run_id, 2)
    assert a == b  # one model
    run = next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)
    assert run["state"] == "succeeded" and run["epoch"] == 8
    assert [(g["instance_id"], g["node_ids"], g["end"]) for g in run["segments"]] == [
        (chief["InstanceId"], [worker["InstanceId"]], "preempted"),
        (new_chief["InstanceId"], [new_worker["InstanceId"]], "succeeded")]
    (rc,) = json.loads(gpuctl("cost", "--json", run_id).stdout)["runs"]
    assert [e["epoch"] for e in rc["epochs"]] == [1, 2, 3, 4, 5, 6, 7, 8]  # each once
    first, second = rc["segments"]
    # EC2 took the worker's machine in its first hour (free); gpuctl ended the chief's (billed).
    assert not first["free"] and first["usd"] == pytest.approx(first["seconds"] * rc["usd_per_hour"] / 2 / 3600, rel=1e-3)
    assert second["usd"] == pytest.approx(second["seconds"] * rc["usd_per_hour"] / 3600, rel=1e-3)
    gpuctl("down", "-y")
    assert live_instances(aws) == []
