"""Volumes on aws, against the moto server over HTTP (tests/aws.py): `volume create` makes an
encrypted gp3 volume tagged as gpuctl's (in the ledger as it is made), `up --volume` launches in
its zone and attaches it to the chief (DeleteOnTermination false), `volume rm` is refused while
it is attached and names the cluster to `down`, `down` leaves it, `volume rm` then deletes it.

The mount on the instance (mkfs, mount) is not run here: moto attaches no device and these `up`s
do not wait for SSH (--no-wait: the first `train` would mount it). The script that does it is
tested in tests/unit/test_volume_mount.py; the device itself only on a real EC2 instance.

Bad inputs tried: `up --zone` other than the volume's zone, a volume another live cluster has,
`volume create` in a zone that does not offer the type; each creates nothing."""

import json

from tests.aws import live_instances, nothing_created

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]


def tags(item):
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def volumes(ec2):
    return ec2.describe_volumes(Filters=[{"Name": "tag-key", "Values": ["gpuctl:volume"]}])["Volumes"]


def test_create_attach_at_up_refused_rm_down_keeps_it_rm(gpuctl, aws, isolated):
    made = json.loads(gpuctl("volume", "create", "data", "--size", "50", "--zone", "us-east-1b", "-y", "--json").stdout)
    (vol,) = volumes(aws)
    assert made["id"] == vol["VolumeId"] and made["zone"] == "us-east-1b" and made["path"] == "/mnt/gpuctl/data"
    assert vol["Size"] == 50 and vol["VolumeType"] == "gp3" and vol["Encrypted"] and vol["AvailabilityZone"] == "us-east-1b"
    owner = (isolated / "owner").read_text().strip()
    assert tags(vol) == {"gpuctl:volume": "data", "gpuctl:owner": owner, "gpuctl:created-by": "gpuctl",
                         "Name": "gpuctl-volume-data"}
    (row,) = json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]
    assert row["monthly_usd"] == 50 * 0.08 and row["used_by"] == "" and row["state"] == "available"

    out = gpuctl(*UP, "--volume", "data")
    assert "attached to" in out.stderr
    (inst,) = live_instances(aws)
    assert inst["Placement"]["AvailabilityZone"] == "us-east-1b"  # the volume's zone, whatever spot costs elsewhere
    (vol,) = volumes(aws)
    (att,) = vol["Attachments"]
    assert att["InstanceId"] == inst["InstanceId"] and att["Device"] == "/dev/sdf"
    # The instance's termination leaves it (AttachVolume's default; moto reports it on the instance).
    (inst,) = live_instances(aws)
    (mapping,) = [m for m in inst["BlockDeviceMappings"] if m["DeviceName"] == "/dev/sdf"]
    assert mapping["Ebs"]["VolumeId"] == vol["VolumeId"] and mapping["Ebs"].get("DeleteOnTermination") is False
    assert json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"][0]["used_by"] == "default"

    err = gpuctl("volume", "rm", "data", "-y", code=5).stderr
    assert "Error: volume 'data' is attached to cluster 'default'" in err and "gpuctl down default" in err
    assert len(volumes(aws)) == 1

    gpuctl("down", "-y")
    (vol,) = volumes(aws)  # `down` released the instance, not the volume
    assert not [a for a in vol["Attachments"] if a.get("State") == "attached"]
    cost = json.loads(gpuctl("cost", "--json").stdout)["volumes"]
    assert cost["gb"] == 50 and cost["usd_per_month"] == 4.0

    gpuctl("volume", "rm", "data", "-y")
    assert volumes(aws) == []
    assert json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"] == []


def test_a_zone_other_than_the_volumes_is_refused_before_anything_exists(gpuctl, aws):
    gpuctl("volume", "create", "data", "--size", "10", "--zone", "us-east-1b", "-y")
    err = gpuctl(*UP, "--zone", "us-east-1a", "--volume", "data", code=3).stderr
    assert err.startswith("Error: volume 'data' is in us-east-1b, not in --zone us-east-1a") and "Hint:" in err
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_a_volume_attached_to_another_live_cluster_is_refused(gpuctl, aws):
    gpuctl("volume", "create", "data", "--size", "10", "-y")
    gpuctl(*UP, "--name", "first", "--volume", "data")
    err = gpuctl(*UP, "--name", "second", "--volume", "data", code=5).stderr
    assert "Error: volume 'data' is attached to cluster 'first'" in err and "gpuctl down first" in err
    assert len(live_instances(aws)) == 1
    gpuctl("down", "--all", "-y")
    assert len(volumes(aws)) == 1


def test_a_zone_that_does_not_offer_the_type_is_refused(gpuctl, aws):
    err = gpuctl("volume", "create", "data", "--size", "10", "--zone", "us-east-1z", "-y", code=3).stderr
    assert err.startswith("Error: zone us-east-1z does not offer g5.xlarge") and "Hint: Pick one that does" in err
    assert volumes(aws) == []


def test_a_volume_the_ledger_lost_is_found_by_its_tags(gpuctl, aws, isolated):
    gpuctl("volume", "create", "data", "--size", "10", "-y")
    (isolated / "ledger.sqlite3").unlink()
    for suffix in ("-wal", "-shm"):
        (isolated / f"ledger.sqlite3{suffix}").unlink(missing_ok=True)
    (row,) = json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]
    assert row["name"] == "data" and row["size_gb"] == 10
    gpuctl("volume", "rm", "data", "-y")
    assert volumes(aws) == []


def test_a_volume_attached_to_an_instance_no_cluster_has_is_refused_by_up_and_rm(gpuctl, aws):
    made = json.loads(gpuctl("volume", "create", "data", "--size", "10", "--zone", "us-east-1a", "-y", "--json").stdout)
    (image,) = aws.describe_images(Owners=["amazon"])["Images"][:1]
    other = aws.run_instances(ImageId=image["ImageId"], MinCount=1, MaxCount=1, InstanceType="t3.micro",
                              Placement={"AvailabilityZone": "us-east-1a"})["Instances"][0]["InstanceId"]
    aws.attach_volume(VolumeId=made["id"], InstanceId=other, Device="/dev/sdg")
    err = gpuctl(*UP, "--volume", "data", code=5).stderr
    assert f"Error: volume 'data' is attached to instance {other}, which no cluster of this gpuctl home has" in err
    assert "Hint: Detach it from that instance" in err and live_instances(aws) == []
    err = gpuctl("volume", "rm", "data", "-y", code=5).stderr
    assert f"attached to instance {other}" in err and len(volumes(aws)) == 1


def test_ls_without_credentials_still_lists_what_the_ledger_knows(gpuctl, aws, monkeypatch):
    gpuctl("volume", "create", "data", "--size", "10", "-y")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    res = gpuctl("volume", "ls")
    assert "note: aws not asked: no AWS credentials found" in res.stderr and "data" in res.stdout
    err = gpuctl("volume", "rm", "data", "-y", code=9).stderr  # deleting needs AWS's word: refused, nothing deleted
    assert "Error: no AWS credentials found" in err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert len(volumes(aws)) == 1
