"""Multi-node clusters on the aws provider, against a moto server over real HTTP (tests/aws.py):
every node in one zone or none, ranks tagged at creation, one security group open between the
nodes, an optional cluster placement group, and reuse only of a whole cluster.

Capacity answers are injected into the in-process moto backend as tests/integration/test_aws.py
does, so they still reach gpuctl over HTTP as AWS sends them. moto has no placement groups: the
three calls are added by tests/aws.py (placement_groups_as_aws_does), with AWS's errors."""

from __future__ import annotations

import json

import pytest

from tests.aws import gpuctl_groups, gpuctl_keys, live_instances, nothing_created
from tests.integration.test_aws import UP, _fail_run_instances, tag_dict

UP2 = [*UP, "--nodes", "2"]


def placement_groups(ec2):
    return ec2.describe_placement_groups(Filters=[{"Name": "tag:gpuctl:created-by", "Values": ["gpuctl"]}])[
        "PlacementGroups"]


def by_rank(instances):
    return sorted(instances, key=lambda i: int(tag_dict(i)["gpuctl:node"]))


def ledger_instances(home, cluster="default"):
    from gpuctl.ledger import Ledger

    ledger = Ledger(home)
    return ledger.instances(ledger.live_cluster(cluster).id)


def test_two_nodes_share_one_zone_one_group_and_are_ranked(gpuctl, aws, isolated):
    gpuctl(*UP2)
    insts = by_rank(live_instances(aws))
    assert len(insts) == 2 and all(i["State"]["Name"] == "running" for i in insts)
    assert [tag_dict(i)["gpuctl:node"] for i in insts] == ["0", "1"]
    assert len({i["Placement"]["AvailabilityZone"] for i in insts}) == 1
    for inst in insts:  # every safety default holds for every node
        assert inst["MetadataOptions"]["HttpTokens"] == "required" and inst["InstanceLifecycle"] == "spot"
        vols = aws.describe_volumes(VolumeIds=[m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]])["Volumes"]
        assert all(v["Encrypted"] for v in vols)
        root = next(v for v in vols if v["Attachments"][0]["Device"] == "/dev/sda1")
        assert tag_dict(root)["gpuctl:node"] == tag_dict(inst)["gpuctl:node"]
    (group,) = gpuctl_groups(aws)
    assert {g["GroupId"] for i in insts for n in i["NetworkInterfaces"] for g in n["Groups"]} == {group["GroupId"]}
    # The nodes reach each other on every port (MultiWorkerMirroredStrategy picks its own); the
    # world reaches only SSH, from the one address asked.
    self_rules = [p for p in group["IpPermissions"]
                  if any(pair["GroupId"] == group["GroupId"] for pair in p.get("UserIdGroupPairs", []))]
    assert [p["IpProtocol"] for p in self_rules] == ["-1"]
    assert [r["CidrIp"] for p in group["IpPermissions"] for r in p.get("IpRanges", [])] == ["203.0.113.5/32"]

    recs = ledger_instances(isolated)
    assert [(r.id, r.node) for r in recs] == [(i["InstanceId"], n) for n, i in enumerate(insts)]
    assert all(r.private_ip and r.zone == insts[0]["Placement"]["AvailabilityZone"] for r in recs)
    assert recs[0].usd_per_hour == recs[1].usd_per_hour > 0
    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["clusters"][0]["usd_per_hour"] == pytest.approx(2 * recs[0].usd_per_hour)

    out = gpuctl("down", "-y").stdout
    assert "released 5 resource(s)" in out  # 2 instances, the group, the key pair, the instance profile
    nothing_created(aws)


def test_no_room_for_the_second_node_moves_both_to_the_next_zone(gpuctl, aws, isolated, monkeypatch):
    first: list[str] = []

    def failing(zone, market):
        if not first:
            first.append(zone)
            return None  # node 0 fits in the first zone...
        return "InsufficientInstanceCapacity" if zone == first[0] else None  # ...node 1 does not

    seen = _fail_run_instances(monkeypatch, failing)
    res = gpuctl(*UP2)
    assert [z for z, _ in seen][:2] == [first[0], first[0]] and len(seen) == 4
    insts = live_instances(aws)
    assert len(insts) == 2 and {i["Placement"]["AvailabilityZone"] for i in insts} == {seen[2][0]} != {first[0]}
    assert f"{first[0]}: node 1: InsufficientInstanceCapacity: terminating node(s) 0..0" in res.stderr
    # The first zone's node 0 was ended before the next zone was tried, not left behind.
    ended = [i for r in aws.describe_instances(Filters=[{"Name": "tag:gpuctl:created-by", "Values": ["gpuctl"]}])[
        "Reservations"] for i in r["Instances"] if i["State"]["Name"] == "terminated"]
    assert len(ended) == 1 and ended[0]["Placement"]["AvailabilityZone"] == first[0]
    # The ledger recorded it as EC2 gave its id (it billed its minute) and saw it end.
    recs = ledger_instances(isolated)
    assert sorted(r.node for r in recs if r.state == "running") == [0, 1]
    assert [(r.id, r.state) for r in recs if r.state != "running"] == [(ended[0]["InstanceId"], "terminated")]


def test_no_zone_with_room_for_every_node_leaves_nothing_running(gpuctl, aws, monkeypatch):
    # Node 0 always fits, node 1 never: each zone launches one and must end it.
    count = {"n": 0}

    def failing(zone, market):
        count["n"] += 1
        return None if count["n"] % 2 else "InsufficientInstanceCapacity"

    seen = _fail_run_instances(monkeypatch, failing)
    res = gpuctl(*UP2, code=10)
    zones = sorted({z for z, _ in seen})
    assert len(zones) >= 2 and len(seen) == 2 * len(zones)
    line = next(line for line in res.stderr.splitlines() if line.startswith("Error:"))
    assert "no capacity for 2 x g5.xlarge in one zone" in line
    for z in zones:
        assert f"{z} spot: InsufficientInstanceCapacity (node 1)" in line
    assert live_instances(aws) == []
    assert "Still running" not in res.stderr  # each zone's node 0 was recorded, and seen to end
    # What today's single-node failure leaves (group, key pair, profile) `down --all` removes.
    assert gpuctl_groups(aws) and gpuctl_keys(aws)
    gpuctl("down", "--all", "-y")
    nothing_created(aws)


def test_a_cluster_placement_group_is_made_used_and_released(gpuctl, aws, isolated):
    res = gpuctl(*UP2, "--placement", "cluster")
    (pg,) = placement_groups(aws)
    owner = (isolated / "owner").read_text().strip()
    assert pg["Strategy"] == "cluster" and pg["GroupName"].startswith("gpuctl-default-")
    assert {"gpuctl:cluster": "default", "gpuctl:owner": owner, "gpuctl:created-by": "gpuctl"}.items() <= \
        tag_dict(pg).items()
    assert f"placement group {pg['GroupName']}" in res.stderr
    # moto reports no placement group itself; tests/aws.py's RunInstances refuses an unknown one and
    # records the one asked for, as AWS reports it.
    assert [i["Placement"].get("GroupName") for i in live_instances(aws)] == [pg["GroupName"]] * 2
    inv = json.loads(gpuctl("status", "--all", "--json").stdout)
    assert ("default", "placement-group", pg["GroupName"]) in {(r["cluster"], r["kind"], r["id"]) for r in inv["resources"]}
    out = gpuctl("down", "-y").stdout
    assert "released 6 resource(s)" in out
    assert placement_groups(aws) == []
    nothing_created(aws)


def test_up_again_reuses_every_node_and_a_vanished_node_is_an_error(gpuctl, aws, isolated):
    gpuctl(*UP2)
    ids = [i["InstanceId"] for i in by_rank(live_instances(aws))]
    again = gpuctl(*UP2)
    assert "was already up; reused" in again.stdout and "found by their tags" in again.stderr
    assert [i["InstanceId"] for i in by_rank(live_instances(aws))] == ids
    assert [(r.id, r.node) for r in ledger_instances(isolated)] == [(ids[0], 0), (ids[1], 1)]
    aws.terminate_instances(InstanceIds=[ids[1]])  # node 1 ends (by hand, as an interruption would)
    res = gpuctl(*UP2, code=9)
    assert "cluster 'default' has 1 of its 2 nodes left" in res.stderr and "gpuctl down default -y" in res.stderr
    assert [i["InstanceId"] for i in live_instances(aws)] == [ids[0]]  # nothing launched
    gpuctl("down", "-y")
    nothing_created(aws)


@pytest.mark.parametrize("nodes", ["0", "65", "two"])
def test_bad_node_counts_create_nothing(gpuctl, aws, nodes):
    res = gpuctl(*UP, "--nodes", nodes, code=2)
    assert "--nodes" in res.stderr
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
