"""What an `up` that fails or is interrupted after EC2 started an instance leaves, against a moto
server over real HTTP (tests/aws.py): the instance is in the ledger from the moment EC2 returned
its id, so `status` and `cost` show it running and billing; the failure says which instances run,
at what $/h, and the `down` that ends them. And the question before a launch prices the hard cap
at the most the instance may be billed an hour (spot: its cap), whatever the spot price reads.

The SSH wait fails as every aws test's does: tests/aws.py sends SSH to a closed loopback port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.aws import live_instances, nothing_created
from tests.integration.test_aws import UP

ON_DEMAND = ["up", "--on-demand", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y"]
G5_ON_DEMAND = 1.006  # the built-in table's us-east-1 price (moto has no Price List API)


def ledger_instances(home, cluster="default"):
    from gpuctl.ledger import Ledger

    ledger = Ledger(home)
    try:
        return ledger.instances(ledger.live_cluster(cluster).id)
    finally:
        ledger.close()


def after(stderr: str, marker: str) -> list[str]:
    """The lines of stderr after the first one starting with `marker`."""
    lines = stderr.splitlines()
    at = next(n for n, line in enumerate(lines) if line.startswith(marker))
    return lines[at + 1:]


def test_an_up_whose_ssh_wait_fails_leaves_its_instance_recorded_running_and_billed(gpuctl, aws, isolated):
    # Before: the ledger recorded the instance only once the SSH wait returned, so `status` said
    # "up 0.0s $0.0000" while EC2 billed it, and the error said nothing of it.
    res = gpuctl(*ON_DEMAND, code=7)
    (inst,) = live_instances(aws)
    iid = inst["InstanceId"]
    tail = after(res.stderr, "Hint:")
    assert 1 <= len(tail) <= 2, res.stderr
    said = " ".join(tail)
    assert iid in said and f"${G5_ON_DEMAND:.4f}/h" in said and "gpuctl down default -y" in said

    (rec,) = ledger_instances(isolated)
    assert rec.id == iid and rec.state == "running" and rec.market == "on-demand"
    assert rec.instance_type == "g5.xlarge" and rec.usd_per_hour == pytest.approx(G5_ON_DEMAND)
    assert rec.launched_at == pytest.approx(inst["LaunchTime"].timestamp(), abs=1.0)

    time.sleep(1.5)
    (cluster,) = json.loads(gpuctl("status", "--json").stdout)["clusters"]
    assert cluster["state"] == "up" and cluster["instances"] == 1 and cluster["uptime_s"] > 1.0
    assert cluster["usd_per_hour"] == pytest.approx(G5_ON_DEMAND)
    # EC2 bills a started instance 60 s at least: a fresh one has cost that already.
    assert cluster["compute_usd"] == pytest.approx(60 * G5_ON_DEMAND / 3600)
    (billed,) = json.loads(gpuctl("cost", "--json").stdout)["clusters"]
    assert billed["usd"] > 0 and billed["uptime_s"] > 1.0

    gpuctl("down", "default", "-y")
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_ctrl_c_right_after_the_launch_names_the_running_instance_and_its_down(aws, isolated):
    """A real SIGINT to a real gpuctl, as a terminal's Ctrl-C, once it printed "launched i-"."""
    env = dict(os.environ, GPUCTL_REMOTE__CONNECT_TIMEOUT_S="120")  # the SSH wait outlasts the test
    # SIGINT as a terminal's shell leaves it (xdist's workers ignore it; a child would inherit that).
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", *UP[:-2], "-y"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line.rstrip("\n"))
        if line.strip().startswith("launched i-"):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=60)[1]
    stderr = "\n".join(seen) + "\n" + rest
    assert proc.returncode == 130, stderr
    (inst,) = live_instances(aws)
    iid = inst["InstanceId"]
    tail = after(stderr, "Interrupted.")
    assert 1 <= len(tail) <= 2, stderr
    said = " ".join(tail)
    # moto's spot price reads $0.00001/h: what it may bill is the spot cap, the on-demand price.
    assert iid in said and "spot" in said and f"${G5_ON_DEMAND:.4f}/h" in said, stderr
    assert "gpuctl down default -y" in said

    (rec,) = ledger_instances(isolated)
    assert rec.id == iid and rec.market == "spot" and rec.instance_type == "g5.xlarge"
    assert rec.max_usd_per_hour == pytest.approx(G5_ON_DEMAND)
    status = subprocess.run([sys.executable, "-m", "gpuctl", "status", "--json"], capture_output=True, text=True,
                            env=env, timeout=60)
    (cluster,) = json.loads(status.stdout)["clusters"]
    assert cluster["state"] == "up" and cluster["instances"] == 1 and cluster["usd"] > 0
    down = subprocess.run([sys.executable, "-m", "gpuctl", "down", "default", "-y"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    nothing_created(aws)


def test_each_node_is_recorded_as_its_id_comes_back(gpuctl, aws, isolated, monkeypatch):
    """Two nodes, their SSH wait failing: node 0 is in the ledger before node 1 is asked for, and
    the error names both."""
    from moto.ec2.models import EC2Backend

    original = EC2Backend.run_instances
    recorded: list[list[str]] = []  # what the ledger held as each RunInstances reached EC2

    def run_instances(self, *args, **kwargs):
        recorded.append([r.id for r in ledger_instances(isolated)])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EC2Backend, "run_instances", run_instances)
    res = gpuctl(*UP[:-2], "-y", "--nodes", "2", code=7)
    first, second = sorted(live_instances(aws), key=lambda i: next(
        t["Value"] for t in i["Tags"] if t["Key"] == "gpuctl:node"))
    assert recorded == [[], [first["InstanceId"]]]
    recs = ledger_instances(isolated)
    assert [(r.id, r.node, r.state) for r in recs] == [(first["InstanceId"], 0, "running"),
                                                       (second["InstanceId"], 1, "running")]
    said = " ".join(after(res.stderr, "Hint:"))
    assert first["InstanceId"] in said and second["InstanceId"] in said and "gpuctl down default -y" in said
    gpuctl("down", "-y")
    nothing_created(aws)


def test_the_question_prices_the_hard_cap_at_the_spot_cap_not_the_spot_price_now(gpuctl, aws):
    # moto's spot price reads $0.00001/h: "8 h x $0.0000/h = $0.00" was the worst case said.
    base = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait"]
    err = gpuctl(*base, code=2).stderr  # no terminal: the question is the error
    assert "at $0.0000/h (spot price in us-east-1" in err  # the price now, as it reads
    assert "spot cap $1.0060/h a node (the on-demand price, AWS's default)" in err
    assert "8 h hard cap (8 h x $1.0060/h at the spot cap = $8.05)" in err
    capped = gpuctl(*base, "--max-price", "0.5", "--max-hours", "2", code=2).stderr
    assert "2 h hard cap (2 h x $0.5000/h at the spot cap = $1.00)" in capped
    two = gpuctl(*base, "--nodes", "2", code=2).stderr
    assert "8 h hard cap (8 h x $2.0120/h at the spot cap = $16.10)" in two
    nothing_created(aws)


def test_a_record_made_before_ec2_gave_addresses_gets_them_at_the_next_look(aws):
    """EC2's answer to RunInstances has no public address yet (moto's has one: the record here is
    made as AWS's answer would make it); `status` after an interrupted `up` fills it in, so that
    `train` and `down` reach the instance."""
    from gpuctl.model.records import InstanceRecord
    from gpuctl.provision.aws.lifecycle import reconcile
    from gpuctl.provision.aws.session import Aws
    from tests.aws import NEWEST_X86

    inst = aws.run_instances(ImageId=NEWEST_X86[0], InstanceType="g5.xlarge", MinCount=1, MaxCount=1)["Instances"][0]
    rec = InstanceRecord(id=inst["InstanceId"], cluster="default", state="pending", market="on-demand",
                         launched_at=inst["LaunchTime"].timestamp(), workdir="/home/ubuntu/gpuctl", region="us-east-1")
    (now,) = aws.describe_instances(InstanceIds=[inst["InstanceId"]])["Reservations"][0]["Instances"]
    (fresh,) = reconcile(lambda region: Aws(region=region or "us-east-1"), [rec])
    assert fresh.state == "running"
    assert (fresh.public_ip, fresh.private_ip) == (now["PublicIpAddress"], now["PrivateIpAddress"])
