"""The aws provider against a moto server over real HTTP (see tests/aws.py).

moto cannot produce capacity, quota or "no spot offering" answers by itself; those tests change
the backend of the in-process ThreadedMotoServer, so the errors still travel over HTTP as AWS
sends them. Bad inputs tried: unknown type (typo), unknown region, no credentials, --max-price
that is negative, zero or not a number, spot for a type with no spot offering, an unknown AMI id,
a malformed --ssh-cidr, no --ssh-cidr when the public IP cannot be detected."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from gpuctl.provision.aws import access
from tests.aws import BASE_AMIS, NEWEST_X86, boto3_session, gpuctl_groups, gpuctl_keys, live_instances, nothing_created, user_data

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]


def tag_dict(item):
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def test_up_spot_is_safe_by_default(gpuctl, aws, isolated):
    res = gpuctl(*UP)
    assert "Cluster 'default' is up (aws" in res.stdout
    assert NEWEST_X86[0] in res.stdout and NEWEST_X86[1] in res.stdout  # the newest x86 Ubuntu 22.04 base image, named
    (inst,) = live_instances(aws)
    iid = inst["InstanceId"]
    assert inst["InstanceType"] == "g5.xlarge"
    assert inst["InstanceLifecycle"] == "spot"
    assert inst["ImageId"] == NEWEST_X86[0]
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    attr = aws.describe_instance_attribute(InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")
    assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    tags = tag_dict(inst)
    owner = (isolated / "owner").read_text().strip()
    assert tags["gpuctl:cluster"] == "default" and tags["gpuctl:owner"] == owner and tags["gpuctl:created-by"] == "gpuctl"

    vol_ids = [m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]]
    volumes = aws.describe_volumes(VolumeIds=vol_ids)["Volumes"]
    assert volumes and all(v["Encrypted"] for v in volumes)
    root = next(v for v in volumes if v["Attachments"][0]["Device"] == "/dev/sda1")
    assert root["Size"] == 100 and root["VolumeType"] == "gp3"
    assert {"gpuctl:cluster", "gpuctl:owner", "gpuctl:created-by"} <= set(tag_dict(root))

    script = user_data(aws, iid)
    assert "OnBootSec=480min" in script and "systemctl poweroff" in script  # 8 h hard cap, armed at boot
    assert "aws_access_key_id" not in script.lower() and "AKIA" not in script

    (group,) = gpuctl_groups(aws)
    # The group is set on the network interface (moto reports it there, not in SecurityGroups).
    assert {g["GroupId"] for n in inst["NetworkInterfaces"] for g in n["Groups"]} == {group["GroupId"]}
    ssh_rules = [p for p in group["IpPermissions"] if p.get("FromPort") == 22]
    assert [r["CidrIp"] for p in ssh_rules for r in p["IpRanges"]] == ["203.0.113.5/32"]
    # Nothing else is open to any address; nodes of the cluster may talk to each other.
    assert all(not p.get("IpRanges") for p in group["IpPermissions"] if p.get("FromPort") != 22)
    assert any(pair["GroupId"] == group["GroupId"] for p in group["IpPermissions"] for pair in p.get("UserIdGroupPairs", []))

    (key,) = gpuctl_keys(aws)
    assert inst["KeyName"] == key["KeyName"]
    private = isolated / "keys" / "default.us-east-1.pem"
    assert private.stat().st_mode & 0o777 == 0o600
    assert private.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")

    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["clusters"][0]["provider"] == "aws" and status["clusters"][0]["usd_per_hour"] > 0
    from gpuctl.ledger import Ledger

    (rec,) = Ledger(isolated).instances(Ledger(isolated).live_cluster("default").id)
    assert rec.id == iid and rec.usd_per_hour > 0 and rec.price_source == "spot price history"
    assert rec.market == "spot" and rec.region == "us-east-1" and rec.zone == inst["Placement"]["AvailabilityZone"]


def test_down_releases_everything_and_again_is_a_no_op(gpuctl, aws, isolated):
    gpuctl(*UP)
    out = gpuctl("down", "-y").stdout
    assert "Cluster 'default' is down: released 4 resource(s)" in out  # with the checkpoint instance profile
    nothing_created(aws)
    assert not list((isolated / "keys").glob("*.pem"))
    assert "nothing to do" in gpuctl("down", "-y").stdout
    assert "already down" in gpuctl("down", "default", "-y").stdout
    # The ledger keeps the cluster's record and its spend.
    cost = json.loads(gpuctl("cost", "--json").stdout)
    assert cost["clusters"][0]["state"] == "down"


def test_on_demand_uses_the_price_list_or_the_dated_table(gpuctl, aws, isolated):
    res = gpuctl("up", "--on-demand", "--type", "g5.xlarge", "--ssh-cidr", "198.51.100.0/24", "--no-wait", "-y")
    (inst,) = live_instances(aws)
    assert "InstanceLifecycle" not in inst
    # moto has no Price List API: the built-in table answers, and says so.
    assert "$1.0060/h (built-in table (2025-01, us-east-1))" in res.stdout


def test_up_again_reuses_the_cluster_and_a_leak_is_reported(gpuctl, aws):
    gpuctl(*UP)
    again = gpuctl(*UP)
    assert "was already up; reused" in again.stdout
    assert len(live_instances(aws)) == 1
    other = gpuctl("up", "--on-demand", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y", code=5)
    assert "other settings (market: spot -> on-demand)" in other.stderr
    # A second instance carrying the cluster's tags (as a crashed older gpuctl might leave).
    (inst,) = live_instances(aws)
    aws.run_instances(ImageId=NEWEST_X86[0], InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
                      TagSpecifications=[{"ResourceType": "instance", "Tags": inst["Tags"]}])
    leak = gpuctl(*UP, code=9)
    assert "found 2 instances tagged for cluster 'default' where 1 was asked" in leak.stderr
    gpuctl("down", "-y")
    nothing_created(aws)


def test_pinned_image_and_options(gpuctl, aws):
    old = BASE_AMIS[0][0]  # not the one gpuctl would choose: --image wins
    res = gpuctl("up", "--image", old, "--disk-gb", "250", "--max-hours", "1.5", "--max-price", "0.9", *UP[1:])
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == old and "pinned with --image" in res.stderr
    vols = aws.describe_volumes(VolumeIds=[m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]])["Volumes"]
    assert vols[0]["Size"] == 250
    assert "OnBootSec=90min" in user_data(aws, inst["InstanceId"])


def test_open_to_the_world_only_when_asked_and_with_a_warning(gpuctl, aws):
    res = gpuctl("up", "--ssh-cidr", "0.0.0.0/0", "--no-wait", "-y")
    assert "WARNING: SSH is open to the whole internet (0.0.0.0/0)" in res.stderr
    (group,) = gpuctl_groups(aws)
    assert [r["CidrIp"] for p in group["IpPermissions"] if p.get("FromPort") == 22 for r in p["IpRanges"]] == ["0.0.0.0/0"]
    gpuctl("down", "-y")
    # Half the internet is no narrower: any range wider than a /16 gets the warning.
    res = gpuctl("up", "--ssh-cidr", "0.0.0.0/1", "--no-wait", "-y")
    assert "WARNING: SSH is open to 2,147,483,648 addresses (0.0.0.0/1)" in res.stderr


def _ingress(aws):
    (group,) = gpuctl_groups(aws)
    out = set()
    for p in group["IpPermissions"]:
        for field, key in (("IpRanges", "CidrIp"), ("Ipv6Ranges", "CidrIpv6"), ("UserIdGroupPairs", "GroupId")):
            out |= {(p["IpProtocol"], p.get("FromPort"), r[key] if key != "GroupId" else "self") for r in p[field]}
    return out


def test_a_reused_group_lets_in_exactly_what_this_up_asks(gpuctl, aws, monkeypatch):
    # An `up` that opened SSH to the world and died after creating its group (as a kill would
    # leave it: the cluster stays up in the ledger), plus a rule someone added by hand.
    failing = [True]
    _fail_run_instances(monkeypatch, lambda z, m: "InsufficientInstanceCapacity" if failing[0] else None)
    gpuctl("up", "--ssh-cidr", "0.0.0.0/0", "--no-wait", "-y", code=10)
    (group,) = gpuctl_groups(aws)
    aws.authorize_security_group_ingress(GroupId=group["GroupId"], IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 8888, "ToPort": 8888, "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}])
    failing[0] = False
    res = gpuctl(*UP)
    assert _ingress(aws) == {("tcp", 22, "203.0.113.5/32"), ("-1", None, "self")}
    assert "revoked tcp 22 from 0.0.0.0/0" in res.stderr and "revoked tcp 8888 from ::/0" in res.stderr
    assert "SSH from 203.0.113.5/32 only" in res.stderr and "WARNING" not in res.stderr
    # `up` again on the running cluster, from another address (IPv6 too): the group follows.
    res = gpuctl(*UP[:4], "--ssh-cidr", "2001:db8::5/128", "--no-wait", "-y")
    assert "reused" in res.stdout and "revoked tcp 22 from 203.0.113.5/32" in res.stderr
    assert _ingress(aws) == {("tcp", 22, "2001:db8::5/128"), ("-1", None, "self")}
    assert len(live_instances(aws)) == 1


def test_a_lost_home_still_sees_what_it_made_and_any_owner_releases_it(gpuctl, aws, isolated):
    import shutil

    gpuctl(*UP)
    old = (isolated / "owner").read_text().strip()
    shutil.rmtree(isolated)  # the whole gpuctl home is gone: this install gets a new owner id
    gpuctl(*UP)  # ...and a cluster of its own with the same name
    new = (isolated / "owner").read_text().strip()
    assert new != old
    inv = json.loads(gpuctl("status", "--all", "--json").stdout)
    found = [r for r in inv["resources"] if r["provider"] == "aws"]
    mine = sorted(r["kind"] for r in found if r["cluster"] == "default")
    others = [r for r in found if r["cluster"] is None]
    assert mine == sorted(r["kind"] for r in others) == ["instance", "instance-profile", "key-pair", "security-group"]
    assert all(f"another owner's: {old}, cluster default" in r["state"] for r in others)
    assert any("4 resource(s) belong to another owner" in n and "--any-owner" in n for n in inv["notes"])
    assert "another owner's" in gpuctl("status", "--all").stdout
    # Bad inputs destroy nothing: --any-owner alone, or with no terminal to confirm on.
    assert "--any-owner goes with --all" in gpuctl("down", "--any-owner", "-y", code=2).stderr
    assert "without confirmation" in gpuctl("down", "--all", "--any-owner", code=2).stderr
    assert len(live_instances(aws)) == 2
    # Plain --all releases this install's and says what it left.
    res = gpuctl("down", "--all", "-y")
    assert "left 4 resource(s) of other owners" in res.stderr
    (left,) = live_instances(aws)
    assert {t["Key"]: t["Value"] for t in left["Tags"]}["gpuctl:owner"] == old
    gpuctl("down", "--all", "--any-owner", "-y")
    nothing_created(aws)


# --- the caller's address ----------------------------------------------------------------------


class _CheckIp(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"203.0.113.77\n")

    def log_message(self, *args):
        pass


def test_ssh_is_opened_to_the_detected_address(gpuctl, aws, monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), _CheckIp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(access, "CHECKIP_URL", f"http://127.0.0.1:{server.server_port}/")
    try:
        gpuctl("up", "--no-wait", "-y")
    finally:
        server.shutdown()
    (group,) = gpuctl_groups(aws)
    assert [r["CidrIp"] for p in group["IpPermissions"] if p.get("FromPort") == 22 for r in p["IpRanges"]] == ["203.0.113.77/32"]


def test_undetectable_address_is_refused_before_anything_exists(gpuctl, aws, monkeypatch):
    with __import__("socket").socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(access, "CHECKIP_URL", f"http://127.0.0.1:{port}/")
    res = gpuctl("up", "--no-wait", "-y", code=3)
    assert "could not detect this machine's public IP" in res.stderr and "--ssh-cidr" in res.stderr
    nothing_created(aws)


# --- bad inputs: clear error, exit code, nothing created ------------------------------------------


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--type", "g5.xlargee"], 3, "Did you mean 'g5.xlarge'?"),
        (["--type", "p9.mega"], 3, "unknown instance type 'p9.mega'"),
        (["--region", "us-east-9"], 3, "unknown AWS region 'us-east-9'"),
        (["--max-price", "-1"], 2, "is not a positive number"),
        (["--max-price", "0"], 2, "is not a positive number"),
        (["--max-price", "cheap"], 2, "is not a number"),
        (["--max-hours", "0"], 2, "is not a positive number"),
        (["--max-hours", "inf"], 2, "is not a finite number"),  # no cap at all
        (["--image", "ami-0000000000deadbee"], 9, "ami-0000000000deadbee"),
        (["--ssh-cidr", "10.0.0.300/32"], 3, "aws.ssh_cidr"),
        (["--disk-gb", "2"], 3, "aws.disk_gb"),
        (["--tf", "9.99"], 3, "--tf 9.99: no such TensorFlow release"),  # not in the dated list
        (["--tf", "abc"], 3, "train.tensorflow"),
    ],
)
def test_bad_up_inputs_create_nothing(gpuctl, aws, isolated, args, code, needle):
    base = ["up", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]
    res = gpuctl(*base, *args, code=code)
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    nothing_created(aws)
    # Not even in the ledger: an `up` that created nothing leaves no row.
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_type_hints_never_suggest_a_type_the_base_image_refuses(gpuctl, aws):
    # A typo of a P3 type got "Did you mean 'p3dn.24xlarge'?", which `up` then refuses on the base image.
    base = ["up", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]
    hint = next(line for line in gpuctl(*base, "--type", "p3dn.24xlargee", code=3).stderr.splitlines()
                if line.startswith("Hint:"))
    assert "Did you mean" in hint and "p3" not in hint
    nothing_created(aws)
    refused = gpuctl(*base, "--type", "p3dn.24xlarge", code=3).stderr
    assert "cannot boot the Base OSS" in refused and "p3" not in refused.split("Hint:")[1]
    nothing_created(aws)


def test_no_credentials(gpuctl, aws, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    res = gpuctl(*UP, code=9)
    assert "Error: no AWS credentials found" in res.stderr and "aws sso login" in res.stderr
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    nothing_created(aws)


def _fail_run_instances(monkeypatch, failing):
    """Make the moto backend answer RunInstances with an AWS error code for the given zones."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models import EC2Backend

    original = EC2Backend.run_instances
    seen = []

    def run_instances(self, image_id, count, user_data, security_group_names, **kwargs):
        subnet = kwargs["nics"][0]["SubnetId"]
        zone = self.get_subnet(subnet).availability_zone
        market = "spot" if kwargs.get("instance_market_options") else "on-demand"
        seen.append((zone, market))
        code = failing(zone, market)
        if code:
            raise EC2ClientError(code, f"We currently do not have sufficient capacity in {zone} ({code}).")
        return original(self, image_id, count, user_data, security_group_names, **kwargs)

    monkeypatch.setattr(EC2Backend, "run_instances", run_instances)
    return seen


def test_capacity_errors_move_to_the_next_zone(gpuctl, aws, monkeypatch):
    seen = _fail_run_instances(monkeypatch, lambda z, m: "InsufficientInstanceCapacity" if len(seen) <= 2 else None)
    res = gpuctl(*UP)
    assert len(seen) == 3 and len({z for z, _ in seen}) == 3
    (inst,) = live_instances(aws)
    assert inst["Placement"]["AvailabilityZone"] == seen[-1][0]
    assert "InsufficientInstanceCapacity" in res.stderr


def test_no_capacity_anywhere_names_every_zone(gpuctl, aws, monkeypatch):
    seen = _fail_run_instances(monkeypatch, lambda z, m: "SpotMaxPriceTooLow")
    res = gpuctl(*UP, code=10)
    zones = sorted({z for z, _ in seen})
    assert len(zones) >= 2
    line = next(line for line in res.stderr.splitlines() if line.startswith("Error:"))
    for z in zones:
        assert f"{z} spot: SpotMaxPriceTooLow" in line
    # The key pair and group were created (tagged) before the attempts; down --all finds them.
    gpuctl("down", "--all", "-y")
    nothing_created(aws)


def test_quota_errors_name_the_quota(gpuctl, aws, monkeypatch):
    _fail_run_instances(monkeypatch, lambda z, m: "MaxSpotInstanceCountExceeded")
    res = gpuctl(*UP, code=10)
    assert 'Raise the EC2 quota "All G and VT Spot Instance Requests"' in res.stderr


def test_fallback_on_demand_after_spot_fails_everywhere(gpuctl, aws, monkeypatch):
    seen = _fail_run_instances(monkeypatch, lambda z, m: "InsufficientInstanceCapacity" if m == "spot" else None)
    gpuctl(*UP, "--fallback-on-demand")
    (inst,) = live_instances(aws)
    assert "InstanceLifecycle" not in inst
    assert seen[-1][1] == "on-demand" and all(m == "spot" for _, m in seen[:-1])


def test_no_spot_offering(gpuctl, aws, monkeypatch):
    from moto.ec2.models import EC2Backend

    monkeypatch.setattr(EC2Backend, "describe_spot_price_history", lambda self, types=None, filters=None: [])
    res = gpuctl(*UP, code=9)
    assert "g5.xlarge has no spot offering in us-east-1" in res.stderr and "--fallback-on-demand" in res.stderr
    nothing_created(aws)
    gpuctl(*UP, "--fallback-on-demand")
    assert "InstanceLifecycle" not in live_instances(aws)[0]


def _tagged_key(region: str, cluster: str, owner: str) -> dict:
    """A key pair gpuctl would have made in `region` (tagged as its own), made there directly."""
    tags = [{"Key": "gpuctl:created-by", "Value": "gpuctl"}, {"Key": "gpuctl:cluster", "Value": cluster},
            {"Key": "gpuctl:owner", "Value": owner}]
    ec2 = boto3_session().client("ec2", region_name=region)
    ec2.create_key_pair(KeyName=f"gpuctl-{cluster}", TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}])
    return ec2


def test_status_all_finds_what_the_ledger_lost_and_down_all_removes_it(gpuctl, aws, isolated):
    gpuctl(*UP)
    gpuctl("up", "--name", "second", *UP[1:])
    # A colleague's, in another enabled region: searched; and in a region the account has not opted into: not.
    elsewhere = _tagged_key("eu-west-1", "elsewhere", "colleague")
    closed = _tagged_key("ap-south-1", "closed", "colleague")
    (isolated / "ledger.sqlite3").unlink()  # the laptop's state is gone; the tags are not
    for suffix in ("-wal", "-shm"):
        (isolated / f"ledger.sqlite3{suffix}").unlink(missing_ok=True)
    inv = json.loads(gpuctl("status", "--all", "--json").stdout)
    kinds = sorted((r["cluster"] or "-", r["kind"], r["region"]) for r in inv["resources"] if r["provider"] == "aws")
    assert kinds == sorted([(c, k, "us-east-1") for c in ("default", "second")
                            for k in ("instance", "instance-profile", "key-pair", "security-group")]
                           + [("-", "key-pair", "eu-west-1")])  # another owner's: no cluster of ours
    assert inv["ledger_clusters"] == []
    assert "NO" in gpuctl("status", "--all").stdout
    gpuctl("down", "--all", "--any-owner", "-y")
    nothing_created(aws)
    assert elsewhere.describe_key_pairs()["KeyPairs"] == []
    assert len(closed.describe_key_pairs()["KeyPairs"]) == 1  # never searched (nothing runs there on AWS)
    assert json.loads(gpuctl("status", "--all", "--json").stdout)["resources"] == []


# --- kill -9 in the middle of a launch -----------------------------------------------------------


@pytest.mark.parametrize("stage", ["image ", "key pair ", "security group ", "requesting ", "launched "])
def test_up_killed_at_any_point_leaves_nothing_down_all_cannot_find(gpuctl, aws, stage):
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuctl", *UP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ),
    )
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:  # progress lines, one per step, flushed
        seen.append(line.strip())
        if line.strip().startswith(stage) or time.monotonic() > deadline:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(30)
    assert any(s.startswith(stage) for s in seen), seen
    # The kill landed mid-launch: what the steps before it created is really there to clean up.
    if stage in ("security group ", "requesting ", "launched "):
        assert gpuctl_keys(aws)
    if stage in ("requesting ", "launched "):
        assert gpuctl_groups(aws)
    if stage == "launched ":
        assert live_instances(aws)
    gpuctl("down", "--all", "-y")
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--all", "--json").stdout)["resources"] == []
    # And the ledger agrees: no cluster is left up.
    assert all(c["state"] == "down" for c in json.loads(gpuctl("status", "--json").stdout)["clusters"])



def test_an_instance_ended_by_its_guard_closes_the_cluster_at_ec2s_time(gpuctl, aws):
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    # What a guard's poweroff leads to: EC2 terminates the instance (shutdown behaviour terminate).
    aws.terminate_instances(InstanceIds=[inst["InstanceId"]])
    ended = aws.describe_instances(InstanceIds=[inst["InstanceId"]])["Reservations"][0]["Instances"][0]
    status = json.loads(gpuctl("status", "--json").stdout)
    (cluster,) = status["clusters"]
    assert cluster["state"] == "down" and cluster["note"]
    launched = inst["LaunchTime"].timestamp()
    import datetime as dt
    import re

    m = re.search(r"\((.*) (?:GMT|UTC)\)", ended["StateTransitionReason"])
    at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()
    assert cluster["uptime_s"] == pytest.approx(at - launched, abs=1.0)  # billing closed at EC2's time
    # `down` on the closed cluster still removes what is left of it (its group, key pair and profile),
    # and does not move its end to now.
    time.sleep(1.5)
    out = gpuctl("down", "default", "-y").stdout
    assert "is down: released 3 resource(s)" in out
    nothing_created(aws)
    after = json.loads(gpuctl("cost", "--json").stdout)["clusters"][0]
    assert after["uptime_s"] == pytest.approx(at - launched, abs=1.0)
    assert "already down" in gpuctl("down", "default", "-y").stdout


def test_a_stop_and_a_start_are_billed_as_two_running_periods(gpuctl, aws, isolated):
    from gpuctl.ledger import Ledger
    from gpuctl.model import billing

    gpuctl("up", "--on-demand", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y")
    (inst,) = live_instances(aws)
    iid = inst["InstanceId"]
    aws.stop_instances(InstanceIds=[iid])
    gpuctl("status", "--json")  # sees it stopped: the first period closes at EC2's stop time
    time.sleep(1.2)
    aws.start_instances(InstanceIds=[iid])
    gpuctl("status", "--json")  # sees it running again: a second period opens
    aws.terminate_instances(InstanceIds=[iid])
    cost = json.loads(gpuctl("cost", "--json").stdout)["clusters"][0]
    (rec,) = Ledger(isolated).instances(cost["id"])
    assert len(rec.periods) == 2 and all(b is not None for _, b in rec.periods)
    assert rec.periods[1][0] > rec.periods[0][1]  # not billed while stopped
    # Each period is shorter than a minute here: each is billed the 60 s minimum, at $1.006/h.
    assert cost["compute_usd"] == pytest.approx(billing.compute_cost(rec.periods, [(0, 1.006)]))
    assert cost["compute_usd"] == pytest.approx(2 * 60 * 1.006 / 3600)
    assert cost["storage_usd"] == pytest.approx(billing.storage_cost(100, rec.launched_at, rec.terminated_at))


def _spot_prices(monkeypatch, base=0.3871):
    """Zone prices as AWS quotes them (one zone cheapest, at `base`; a callable `base` is asked at
    every look, for a price that moves): moto answers DescribeSpotPriceHistory with 0.00001 in every
    zone, and nothing in moto sets a price, so its answer is replaced (in the in-process server,
    still over HTTP). The cheapest price and its zone."""
    from moto.core.responses import ActionResult
    from moto.ec2.responses.spot_instances import SpotInstances

    def history(self):
        cheapest = base() if callable(base) else base
        offers = self.ec2_backend.describe_spot_price_history(self._get_param("InstanceTypes", []), {})
        zones = sorted({o["Location"] for o in offers})
        return ActionResult({"SpotPriceHistory": [
            {"InstanceType": o["InstanceType"], "ProductDescription": "Linux/UNIX (Amazon VPC)",
             "SpotPrice": f"{cheapest + 0.0125 * ((zones.index(o['Location']) + 1) % len(zones)):.4f}",
             "AvailabilityZone": o["Location"], "Timestamp": "2026-12-01T20:00:00.000Z"} for o in offers]})

    monkeypatch.setattr(SpotInstances, "describe_spot_price_history", history)
    return base


def _cheapest_spot(aws, instance_type="g5.xlarge"):
    prices = {}
    for item in aws.describe_spot_price_history(InstanceTypes=[instance_type])["SpotPriceHistory"]:
        prices.setdefault(item["AvailabilityZone"], float(item["SpotPrice"]))
    return min(prices.values())


def test_the_launch_question_names_the_price_the_hard_cap_in_dollars_and_the_budget(gpuctl, aws, monkeypatch):
    # "billed until `gpuctl down` or the 8 h hard cap" used to say no dollars at all.
    monkeypatch.setenv("GPUCTL_GUARDS__BUDGET_USD", "5")
    _spot_prices(monkeypatch)
    base = ["up", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait"]
    spot = gpuctl(*base, "--spot", "--nodes", "2", code=2).stderr  # no terminal: the question is the error
    usd = _cheapest_spot(aws) * 2
    assert f"launch 2 x g5.xlarge in one zone (spot) for cluster 'default' at ${usd:,.4f}/h" in spot
    assert "(2 nodes at $" in spot and "spot price in us-east-1" in spot
    assert "spot cap $1.0060/h a node (the on-demand price, AWS's default)" in spot
    # The hard cap's worst case is at the spot cap (both nodes), not at the price now.
    assert "8 h hard cap (8 h x $2.0120/h at the spot cap = $16.10); budget $5.00" in spot
    on_demand = gpuctl(*base, "--on-demand", code=2).stderr
    assert "at $1.0060/h (built-in table (2025-01, us-east-1)), billed until" in on_demand
    assert "(8 h x $1.0060/h = $8.05)" in on_demand
    nothing_created(aws)


def test_a_max_price_under_every_zones_spot_price_is_refused_before_anything_exists(gpuctl, aws, isolated, monkeypatch):
    _spot_prices(monkeypatch)
    cheapest = _cheapest_spot(aws)
    assert cheapest == pytest.approx(0.3871)
    res = gpuctl(*UP, "--max-price", "0.0001", code=3)
    assert f"(cheapest: ${cheapest:.4f}/h in us-east-1" in res.stderr and "Traceback" not in res.stderr
    assert f"Hint: Raise it to at least {cheapest:.4f}" in res.stderr
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    # A cap the cheapest zone meets launches, and the cap in force is said.
    out = gpuctl(*UP, "--max-price", f"{cheapest + 0.01:.4f}").stderr  # progress
    assert f"spot price cap in force: ${cheapest + 0.01:.4f}/h a node (--max-price)" in out


def test_the_user_data_starts_the_idle_watchdog_at_boot(gpuctl, aws, monkeypatch):
    # Before, with `up --no-wait` only the 8 h hard cap was armed until the first `train`.
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "20m")
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    script = user_data(aws, inst["InstanceId"])
    assert "OnBootSec=480min" in script and "gpuctl boot-time idle guard" in script
    from gpuctl.ops.guards import PAYLOAD_DIR
    from gpuctl.payloads.gpuctl_protocol import WATCHDOG_FILES
    from gpuctl.provision.aws.shipped import lean

    assert "gpuctl_decide.py" in WATCHDOG_FILES and "gpuctl_protocol.py" in WATCHDOG_FILES
    for name in WATCHDOG_FILES:  # the code `train` pushes, without its comments (16 KB at most)
        assert lean((PAYLOAD_DIR / name).read_text()).rstrip("\n") in script
    assert '"idle_s": 1200' in script and '"on_fire": "poweroff"' in script
    assert "root=/home/ubuntu/gpuctl" in script and "systemctl enable --now gpuctl-watchdog.service" in script
    # guards.idle = 0 (never): no idle guard at boot, the hard cap alone.
    gpuctl("down", "-y")
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert "idle guard" not in user_data(aws, inst["InstanceId"])


def test_up_launches_at_the_spot_price_it_asked_about_and_reads_ec2s_catalog_once(gpuctl, aws, monkeypatch):
    """The question before the launch and the launch read the type, its zones and their spot
    prices once: the price recorded is the price the user agreed to, though it rose since (each
    read was a round trip to AWS again, and could bill at a price nobody was shown)."""
    from botocore.client import BaseClient

    looks: list[float] = []

    def rising():  # each look at the history a cent dearer, in every zone
        looks.append(0.3871 + 0.01 * len(looks))
        return looks[-1]

    _spot_prices(monkeypatch, rising)
    asked: list[str] = []
    send = BaseClient._make_api_call

    def counted(self, operation, params):
        asked.append(operation)
        return send(self, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", counted)
    out = gpuctl("up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y", "--json").stdout
    up = json.loads(out[out.index("{"):])  # after what moto prints of the Price List it lacks
    assert [asked.count(op) for op in ("DescribeInstanceTypes", "DescribeInstanceTypeOfferings")] == [1, 1]
    assert looks[0] == 0.3871 and asked.count("DescribeSpotPriceHistory") == 1
    (inst,) = up["instances"]
    assert inst["usd_per_hour"] == pytest.approx(0.3871) and inst["price_source"] == "spot price history"
