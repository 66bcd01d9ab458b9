"""`gpuctl image bake` end to end: a moto-launched instance mapped to a real sshd test host (as in
test_aws_e2e.py), its TensorFlow proven by the real preflight there, imaged and tagged in moto
(spot: rebooted by CreateImage, never stopped), the cluster released; the next `up` boots the
baked image. The test hosts have no GPU, so the bake runs with --allow-cpu and makes a CPU-only
image, which the next `up` boots on a type without a GPU. The first test runs the real setup step
(the lab's remote.python is set, and a bake ignores it; pip installs from a local wheelhouse the
small stand-ins of tests/small_wheels.py: the real TensorFlow's install and preflight are
test_setup_step's), and the "instance" booted from the baked image is the same host, so it finds
the env the bake made, as a real one finds it in its image. The bake also carries a project's
requirements.txt (a small wheel): a train of that project on the baked image installs nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from gpuctl.ledger import Ledger
from gpuctl.provision.aws import access
from tests.aws import NEWEST_X86, live_instances, nothing_created
from tests.integration.test_aws_e2e import cloud_init
from tests.integration.test_packages import USES
from tests.small_wheels import wheel

BAKE = ["image", "bake", "--tf", "2.21", "--type", "g5.xlarge", "--spot", "--ssh-cidr", "203.0.113.5/32", "-y"]


def _on_the_lab(ssh, monkeypatch):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={host.ip}")
    return host.base / "authorized_keys"


def test_bake_makes_a_tagged_image_that_the_next_up_boots(gpuctl, aws, ssh, small_wheels, monkeypatch, isolated,
                                                            make_project, tmp_path):
    authorized = _on_the_lab(ssh, monkeypatch)
    lab_key = authorized.read_text()
    work = ssh.hosts[0].base / "bake-work"  # /srv is a small tmpfs
    assert "GPUCTL_REMOTE__PYTHON" in os.environ  # the lab's: a bake ignores it and runs the setup step
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(work))
    wheels = shutil.copytree(small_wheels, tmp_path / "wheels")
    wheel(wheels, "tinydep", "1.0", {"tinydep/__init__.py": 'WORD = "hello"\n'})
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(wheels))
    proj = make_project("with", {"train.py": USES, "requirements.txt": "tinydep==1.0\n"})
    try:
        installer = cloud_init(ssh.hosts[0], isolated, "bake-tf2-21-*")
        res = gpuctl(*BAKE, "--allow-cpu", "--requirements", proj / "requirements.txt", "--json")
        installer.join(60)
    finally:
        authorized.write_text(lab_key)
    baked = json.loads(res.stdout)
    image_id, cluster = baked["image"]["id"], baked["cluster"]
    assert cluster.startswith("bake-tf2-21-") and baked["base_image"] == NEWEST_X86[0]
    assert "bake: starting from" in res.stderr and "preflight on" in res.stderr
    assert "installing tensorflow-cpu (no GPU seen) 2.21" in res.stderr and "ready: TensorFlow 2.21.0" in res.stderr
    assert f"releasing the bake's cluster {cluster}" in res.stderr and "EC2 cannot stop" in res.stderr
    assert "installing 1 requirement(s) of requirements.txt" in res.stderr

    (image,) = aws.describe_images(ImageIds=[image_id])["Images"]
    tags = {t["Key"]: t["Value"] for t in image["Tags"]}
    assert tags == {
        "gpuctl:created-by": "gpuctl", "gpuctl:owner": access.owner_id(isolated), "gpuctl:cluster": cluster,
        "Name": f"gpuctl-{cluster}", "gpuctl:tf-version": "2.21", "gpuctl:tf-installed": "2.21.0",
        "gpuctl:tf-variant": "cpu", "gpuctl:base-image": NEWEST_X86[0], "gpuctl:base-os": "ubuntu-22.04",
        "gpuctl:packages": "requirements.txt (sha256 " + hashlib.sha256(b"tinydep==1.0\n").hexdigest()[:8] + ")"}
    snaps = [m["Ebs"]["SnapshotId"] for m in image["BlockDeviceMappings"]]
    for snap in aws.describe_snapshots(SnapshotIds=snaps)["Snapshots"]:
        assert {t["Key"]: t["Value"] for t in snap["Tags"]} == tags
    assert baked["image"]["size_gb"] > 0 and baked["image"]["usd_per_month"] > 0

    # Released: nothing of the bake runs, the ledger closed its cluster, the image is recorded.
    nothing_created(aws)
    ledger = Ledger(isolated)
    (bake,) = [c for c in ledger.clusters() if c.name == cluster]
    assert bake.state == "down" and [i.id for i, _ in ledger.images()] == [image_id]
    assert json.loads(gpuctl("cost", "--json").stdout)["images"]["images"][0]["id"] == image_id

    monkeypatch.delenv("GPUCTL_REMOTE__PYTHON")  # an `up` with it set skips the setup step's look for the env
    try:
        installer = cloud_init(ssh.hosts[0], isolated)
        # A CPU-only bake (--allow-cpu on the GPU-less lab): `up` boots it only on a type without a GPU.
        res = gpuctl("up", "--spot", "--type", "c5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
        installer.join(60)
        # ... and the project's packages: its train installs nothing.
        trained = gpuctl("train", proj, "--allow-cpu", "--wait")
    finally:
        authorized.write_text(lab_key)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == image_id and "your baked image with TensorFlow 2.21.0" in res.stderr
    # Booted from the baked image, it has the env: no setup step.
    assert f"gpuctl's env {work}/_envs/tf-2.21 (ready)" in res.stderr and "installing" not in res.stderr
    assert "requirements.txt (sha256 " in gpuctl("image", "ls").stdout
    assert "tinydep says hello" in trained.stdout, trained.stdout + trained.stderr
    assert "installing" not in trained.stderr and "requirements.txt ready in" in trained.stderr
    gpuctl("down", "-y")
    ssh.hosts[0].run(f"rm -rf {work}")


def test_a_bake_that_fails_after_launch_still_releases_its_cluster(gpuctl, aws, ssh, monkeypatch, isolated):
    authorized = _on_the_lab(ssh, monkeypatch)
    lab_key = authorized.read_text()
    # The setup step fails on the instance: its wheelhouse holds no TensorFlow (the lab's
    # remote.python, which has one, is ignored by a bake).
    empty = ssh.hosts[0].base / "no-wheels"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(empty))
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(ssh.hosts[0].base / "bake-fail-work"))
    try:
        installer = cloud_init(ssh.hosts[0], isolated, "bake-tf2-21-*")
        res = gpuctl(*BAKE, code=7)
        installer.join(60)
    finally:
        authorized.write_text(lab_key)
        ssh.hosts[0].run(f"rm -rf {ssh.hosts[0].base / 'bake-fail-work'}")
    assert "bake failed: releasing the bake's cluster" in res.stderr
    nothing_created(aws)
    assert aws.describe_images(Owners=["self"])["Images"] == []
    assert all(c.state == "down" for c in Ledger(isolated).clusters())
