"""`up --volume` on aws end to end: moto launches and attaches (tests/aws.py), the instance is a
real sshd test host (GPUCTL_TEST_ENDPOINTS, as in test_aws_e2e.py) whose attached volume is a
real loop device (GPUCTL_TEST_VOLUME_DEVICES: moto attaches no device), so `up` formats and mounts
it over SSH with the real script, blkid, mkfs.ext4 and mount; a job writes into
$GPUCTL_VOLUME_DIR; `down`; the next cluster's `up` mounts it again without formatting and its
job reads the file back. An S3 data set (moto, reached from the host as an instance reaches S3)
fetched by the first cluster lands on the volume, and the second fetches none of it. What stays
EC2's alone: the device names of a real attachment."""

import json
from urllib.parse import urlparse

from tests.aws import live_instances, moto_client
from tests.integration.test_aws_e2e import cloud_init
from tests.integration.test_s3_data import READER, put
from tests.integration.test_volumes import READ, WRITE

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y"]
MOUNTED = "/mnt/gpuctl/data"


def test_a_volume_formatted_and_written_by_one_aws_cluster_is_read_by_the_next(
        gpuctl, aws, ssh, make_project, monkeypatch, isolated, loop_device, moto_server):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", f"http://{host.services_ip}:{urlparse(moto_server).port}")
    put(moto_client("s3"), {"vol/a.bin": b"a" * 5000, "vol/b/c.txt": b"c"})
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", "instance")
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={host.ip}")
    monkeypatch.setenv("GPUCTL_TEST_VOLUME_DEVICES", f"*={loop_device(64)}")
    lab_key = (host.base / "authorized_keys").read_text()
    made = json.loads(gpuctl("volume", "create", "data", "--size", "10", "-y", "--json").stdout)
    try:
        for cluster, project, said, how in (("first", WRITE, "wrote " + MOUNTED, "formatted /dev/loop"),
                                            ("second", READ, "read: fetched once", "mounted /dev/loop")):
            installer = cloud_init(host, isolated, cluster)
            out = gpuctl(*UP, "--name", cluster, "--volume", "data")
            installer.join(60)
            (inst,) = live_instances(aws)
            assert inst["Placement"]["AvailabilityZone"] == made["zone"]
            assert f"volume data: {how}" in out.stderr and f"$GPUCTL_VOLUME_DIR ({MOUNTED})" in out.stderr
            mounts = host.run(f"findmnt -rn -o FSTYPE,TARGET {MOUNTED}").stdout.split()
            assert mounts == ["ext4", MOUNTED]
            job = gpuctl("train", make_project(cluster, {"train.py": project}), "--allow-cpu", "--wait").stdout
            assert said in job
            fetch = json.loads(gpuctl("train", make_project(cluster + "-data", {"train.py": READER}), "--allow-cpu",
                                      "--data", "s3://training-data/vol", "--json").stdout)["data_fetch"]
            assert (fetch["fetched"], fetch["cached"]) == ((2, 0) if cluster == "first" else (0, 2))
            assert fetch["data_dir"].startswith(f"{MOUNTED}/.gpuctl-data/s3-training-data-")
            gpuctl("down", cluster, "-y")
            host.run(f"umount {MOUNTED}")  # the instance is gone, and its mount with it
            (host.base / "authorized_keys").write_text(lab_key)
        (row,) = json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]
        assert row["used_by"] == "" and row["state"] == "available"
    finally:
        host.run(f"umount {MOUNTED} 2>/dev/null; rmdir {MOUNTED} /mnt/gpuctl 2>/dev/null; true")
    gpuctl("volume", "rm", "data", "-y")
