"""Which image `up` boots on today's AWS, and `gpuctl image ls / rm`, against a moto server over HTTP
whose region holds only the Base OSS Nvidia Driver GPU AMIs (tests/aws.py); helpers add a TF DLAMI,
a baked image, or withdraw the SSM parameter.

Bad inputs tried (each: one-line error and hint, non-zero exit, nothing created or destroyed): a
malformed AMI id (`image rm`, `up --image`), an unknown AMI id, an image of another gpuctl install,
an image not made by gpuctl at all, a P3 type with the base image, `image ls` / `image bake` with the
local provider, `--tf 2.x` (up and image bake), a region with no base image and no parameter.
"""

from __future__ import annotations

import json

import pytest

from gpuctl.ledger import Ledger
from gpuctl.provision.aws import access
from tests.aws import (
    BASE_AMIS,
    NEWEST_X86,
    add_baked,
    add_dlami,
    add_image,
    live_instances,
    nothing_created,
    parameter_name,
    remove_parameter,
    user_data,
)

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]


def _kind(home):
    ledger = Ledger(home)
    (rec,) = ledger.instances(ledger.live_cluster("default").id)
    return rec.image_kind


def test_only_base_images_up_picks_the_newest_for_the_type_and_plans_the_setup_step(gpuctl, aws, isolated):
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]
    line = next(ln for ln in res.stderr.splitlines() if ln.strip().startswith("image "))
    # Which image, why, and what the setup step will install on it.
    assert NEWEST_X86[0] in line and NEWEST_X86[1] in line
    assert f"from SSM parameter {parameter_name('x86_64', 'ubuntu-22.04')}" in line
    assert "installs TensorFlow 2.21" in line and "tensorflow[and-cuda]==2.21.*" in line
    assert _kind(isolated) == "base"


@pytest.mark.parametrize("args, env, expected", [
    (["--type", "g5g.xlarge"], {}, BASE_AMIS[3]),  # arm64: the ARM64 build
    ([], {"GPUCTL_AWS__BASE_OS": "ubuntu-24.04"}, BASE_AMIS[2]),
])
def test_the_base_image_follows_the_architecture_and_the_os(gpuctl, aws, monkeypatch, args, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gpuctl(*UP, *args)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == expected[0]


def test_without_the_parameter_describe_images_finds_the_base_image(gpuctl, aws, isolated):
    name = parameter_name("x86_64", "ubuntu-22.04")
    remove_parameter(name)
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]
    assert "the newest named like 'Deep Learning*Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*'" in res.stderr
    assert _kind(isolated) == "base"


def test_a_region_with_no_base_image_names_everything_looked_for(gpuctl, aws, monkeypatch):
    monkeypatch.setenv("GPUCTL_AWS__BASE_OS", "ubuntu-24.04")
    remove_parameter(parameter_name("x86_64", "ubuntu-24.04"))
    from moto.ec2.models import ec2_backends

    ec2_backends["123456789012"]["us-east-1"].amis.pop(BASE_AMIS[2][0])
    res = gpuctl(*UP, code=9)
    err = res.stderr
    assert parameter_name("x86_64", "ubuntu-24.04") in err and "(Ubuntu 24.04)" in err and "us-east-1" in err
    assert "TensorFlow 2.21" in err and "Hint: Pin an AMI with --image" in err
    nothing_created(aws)


def test_a_tensorflow_dlami_is_used_while_aws_still_publishes_one(gpuctl, aws, isolated):
    add_dlami("2.20")  # another version: not it
    dlami = add_dlami("2.21")
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == dlami and "AWS's TensorFlow 2.21 Deep Learning AMI" in res.stderr
    assert _kind(isolated) == "dlami"


def test_a_baked_image_wins_and_is_said(gpuctl, aws, isolated):
    owner = access.owner_id(isolated)
    add_dlami("2.21")
    add_baked(owner, "2.20.1", date="2026-11-29")  # another TF version
    add_baked("someone@else-123456", "2.21.0", date="2026-11-29")  # another install's
    add_baked(owner, "2.21.0", arch="arm64", date="2026-11-29")  # another architecture
    mine = add_baked(owner, "2.21.0", date="2026-11-26")
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == mine
    assert "your baked image with TensorFlow 2.21.0" in res.stderr and "no setup step needed" in res.stderr
    assert _kind(isolated) == "baked"


def test_an_exact_version_asks_for_exactly_that(gpuctl, aws, isolated):
    owner = access.owner_id(isolated)
    add_baked(owner, "2.21.0")
    gpuctl(*UP, "--tf", "2.21.1")
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]  # 2.21.0 is not 2.21.1: the base image and the setup step


def test_image_ls_and_rm_remove_the_image_and_its_snapshots(gpuctl, aws, isolated):
    owner = access.owner_id(isolated)
    keep = add_baked(owner, "2.20.1")
    gone = add_baked(owner, "2.21.0", date="2026-11-28")
    add_baked("someone@else-123456", "2.21.0")  # not listed: another install's
    listed = json.loads(gpuctl("image", "ls", "--json").stdout)
    assert [i["id"] for i in listed["images"]] == [gone, keep]
    first = listed["images"][0]
    assert first["tensorflow"] == "2.21.0" and first["base_image"] == NEWEST_X86[0] and first["size_gb"] > 0
    assert first["usd_per_month"] == pytest.approx(first["size_gb"] * 0.05)
    table = gpuctl("image", "ls").stdout
    assert gone in table and "$0.05/GB-month" in table and "2026-11" in table
    snaps = [m["Ebs"]["SnapshotId"] for m in aws.describe_images(ImageIds=[gone])["Images"][0]["BlockDeviceMappings"]]
    assert snaps

    res = gpuctl("image", "rm", gone, "-y")
    assert f"Removed {gone}" in res.stdout
    assert aws.describe_images(Owners=["self"], Filters=[{"Name": "image-id", "Values": [gone]}])["Images"] == []
    left = {s["SnapshotId"] for s in aws.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    assert not set(snaps) & left
    assert [i["id"] for i in json.loads(gpuctl("image", "ls", "--json").stdout)["images"]] == [keep]

    # cost: from the ledger, the kept image's $/month and what both have cost since they were made.
    storage = json.loads(gpuctl("cost", "--json").stdout)["images"]
    assert {i["id"]: i["state"] for i in storage["images"]} == {keep: "available", gone: "removed"}
    assert storage["usd_per_month"] == pytest.approx(next(i for i in storage["images"] if i["id"] == keep)["size_gb"]
                                                     * 0.05)
    assert storage["accrued_usd"] > 0 and "2026-11" in storage["price"]
    assert "Baked images: 1 kept" in gpuctl("cost").stdout


@pytest.mark.parametrize("image_id, code, message", [
    ("ami-xyz", 3, "'ami-xyz' is not an AMI id"),
    ("i-0123456789abcdef0", 3, "is not an AMI id"),
    ("ami-0123456789abcdef0", 4, "no image ami-0123456789abcdef0 in us-east-1"),
])
def test_image_rm_refuses_bad_ids(gpuctl, aws, isolated, image_id, code, message):
    mine = add_baked(access.owner_id(isolated))
    res = gpuctl("image", "rm", image_id, "-y", code=code)
    assert message in res.stderr and "Hint:" in res.stderr and len(res.stderr.strip().splitlines()) == 2
    assert aws.describe_images(ImageIds=[mine])["Images"]  # nothing destroyed


@pytest.mark.parametrize("whose, message", [
    ("another install", "baked by another gpuctl install (someone@else-123456)"),
    ("not gpuctl", "not made by gpuctl"),
])
def test_image_rm_refuses_an_image_that_is_not_this_installs(gpuctl, aws, isolated, whose, message):
    other = add_baked("someone@else-123456") if whose == "another install" else add_image("golden-image-v3")
    snaps = [m["Ebs"]["SnapshotId"] for m in aws.describe_images(ImageIds=[other])["Images"][0]["BlockDeviceMappings"]]
    res = gpuctl("image", "rm", other, "-y", code=5)
    assert message in res.stderr and "not removing it" in res.stderr and "Hint:" in res.stderr
    assert aws.describe_images(ImageIds=[other])["Images"]
    assert aws.describe_snapshots(SnapshotIds=snaps)["Snapshots"]


def test_a_p3_type_cannot_boot_the_base_image(gpuctl, aws):
    res = gpuctl("up", "--type", "p3dn.24xlarge", "--on-demand", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y",
                 code=3)
    assert "p3dn.24xlarge cannot boot the Base OSS Nvidia Driver GPU AMI" in res.stderr
    assert "Hint: Pick another type" in res.stderr and "--image" in res.stderr
    nothing_created(aws)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_bake_refuses_a_p3_type_before_launching(gpuctl, aws):
    res = gpuctl("image", "bake", "--type", "p3dn.24xlarge", "--ssh-cidr", "203.0.113.5/32", "-y", code=3)
    assert "cannot boot the Base OSS Nvidia Driver GPU AMI" in res.stderr
    nothing_created(aws)


@pytest.mark.parametrize("args", [["image", "ls"], ["image", "rm", "ami-0123456789abcdef0", "-y"],
                                  ["image", "bake", "-y"]])
def test_image_commands_on_a_provider_without_images(gpuctl, aws, monkeypatch, args):
    monkeypatch.setenv("GPUCTL_PROVIDER", "local")
    res = gpuctl(*args, code=3)
    assert "`gpuctl image` is for the aws provider; the local provider has no machine images" in res.stderr
    assert "Hint: Run it with --provider aws" in res.stderr
    nothing_created(aws)
    if args[1] == "ls":  # the hint works (test_provider_aws_on_the_command_line_... tries rm too)
        gpuctl(*args, "--provider", "aws")


@pytest.mark.parametrize("args", [UP[:-1] + ["--tf", "2.x", "-y"],
                                  ["image", "bake", "--tf", "2.x", "--ssh-cidr", "203.0.113.5/32", "-y"]])
def test_a_tensorflow_version_that_is_not_one(gpuctl, aws, args):
    res = gpuctl(*args, code=3)
    assert "2.x" in res.stderr and "Hint:" in res.stderr
    nothing_created(aws)


@pytest.mark.parametrize("make, code, message", [
    (None, 3, "no requirements file"),
    ("dir", 3, "no requirements file"),
    ("big", 6, "is over 256 KiB"),
])
def test_bake_refuses_a_requirements_file_it_cannot_read_before_launching(gpuctl, aws, tmp_path, make, code, message):
    path = tmp_path / "requirements.txt"
    if make == "dir":
        path.mkdir()
    elif make == "big":
        path.write_text("tinydep\n" * 40000)
    res = gpuctl("image", "bake", "--requirements", str(path), "--ssh-cidr", "203.0.113.5/32", "-y", code=code)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert message in line and "Hint:" in res.stderr
    nothing_created(aws)


def _capture_the_default_cluster(aws, installed="2.21.0", variant="cuda"):
    """The capture step of a bake, on the instance of the cluster `up` just launched in moto; the
    lines it printed, with ("created", image) where it said the image exists."""
    from gpuctl.model.images import BakeContents
    from gpuctl.ops.session import open_session

    s = open_session()
    cluster = s.ledger.live_cluster("default")
    (inst,) = s.ledger.instances(cluster.id)
    lines: list = []
    contents = BakeContents(tensorflow="2.21", installed=installed, variant=variant, base_image=NEWEST_X86[0])
    try:
        image = s.provider(cluster.spec).image_store().capture(inst, contents, lines.append,
                                                               lambda made: lines.append(("created", made)))
    finally:
        s.close()
    (state,) = [i["State"]["Name"] for i in live_instances(aws)]
    return image, state, lines


def test_capture_of_a_spot_instance_never_stops_it(gpuctl, aws, isolated):
    # EC2 refuses StopInstances for a one-time spot instance (tests/aws.py makes moto refuse it too):
    # CreateImage reboots it instead.
    gpuctl(*UP)
    image, state, lines = _capture_the_default_cluster(aws)
    assert state == "running" and image.state == "available"
    assert "spot instance, which EC2 cannot stop: CreateImage reboots it" in lines[0]
    assert not any(str(ln).startswith("stopping") for ln in lines)


def test_capture_of_an_on_demand_instance_stops_it_first(gpuctl, aws, isolated):
    gpuctl(*[a if a != "--spot" else "--on-demand" for a in UP])
    image, state, lines = _capture_the_default_cluster(aws)
    assert state == "stopped" and image.state == "available"
    assert lines[0].startswith("stopping i-")


def test_capture_tags_the_snapshots_in_create_image_and_says_so_before_the_wait(gpuctl, aws, isolated, monkeypatch):
    from moto.ec2.responses.tags import TagResponse

    tag, tagged = TagResponse.create_tags, []

    def create_tags(self):  # the CreateTags requests gpuctl sends (the IAM policy refuses it on a snapshot)
        tagged.extend(self._get_param("Resources", []))
        return tag(self)

    monkeypatch.setattr(TagResponse, "create_tags", create_tags)
    gpuctl(*UP)
    image, _, lines = _capture_the_default_cluster(aws)
    made = next(i for i, ln in enumerate(lines) if isinstance(ln, tuple))
    waiting = next(i for i, ln in enumerate(lines) if "waiting for it to be available" in str(ln))
    assert made < waiting and lines[made][1].id == image.id and lines[made][1].state == "pending"
    (described,) = aws.describe_images(ImageIds=[image.id])["Images"]
    tags = {t["Key"]: t["Value"] for t in described["Tags"]}
    assert tags["gpuctl:tf-version"] == "2.21" and tags["gpuctl:tf-installed"] == "2.21.0"
    assert tags["gpuctl:tf-variant"] == "cuda" and "gpuctl-tf2.21.0-ubuntu-22.04-" in image.name
    (snap,) = aws.describe_snapshots(SnapshotIds=list(image.snapshots))["Snapshots"]
    assert {t["Key"]: t["Value"] for t in snap["Tags"]} == tags and tagged == []


@pytest.mark.parametrize("installed", ["2.21.0; reboot", "2.21.0-$(id)", "", "2.21.0 " + "x" * 200])
def test_capture_refuses_a_version_that_is_not_one(gpuctl, aws, isolated, installed):
    from gpuctl.errors import CloudError

    gpuctl(*UP)
    with pytest.raises(CloudError, match="is not a TensorFlow version"):
        _capture_the_default_cluster(aws, installed=installed)
    assert aws.describe_images(Owners=["self"])["Images"] == []


def test_a_bake_is_nobodys_default_runs_the_setup_step_and_powers_off_within_2_hours(aws, isolated, monkeypatch):
    from gpuctl.errors import GpuctlError
    from gpuctl.model.specs import LocalSpec
    from gpuctl.ops import images
    from gpuctl.ops.session import open_session

    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/opt/tf/bin/python3")  # the user's: it would skip the setup step
    monkeypatch.setenv("GPUCTL_AWS__SSH_CIDR", "203.0.113.5/32")
    monkeypatch.setenv("GPUCTL_AWS__WAIT_TIMEOUT_S", "1")  # moto's instance never answers SSH: fails after launch
    s = open_session()
    s.ledger.add_cluster(LocalSpec(name="mine"))
    lines, defaults = [], []

    def progress(line: str) -> None:  # while the bake runs, a `train` elsewhere still lands on "mine"
        lines.append(line)
        defaults.append(s.ledger.default_cluster().name)

    with pytest.raises(GpuctlError):
        images.bake(s, progress)
    assert lines and set(defaults) == {"mine"} and s.ledger.default_cluster().name == "mine"
    (bake,) = [c for c in s.ledger.clusters() if c.name.startswith("bake-")]
    assert bake.spec.remote.python == "" and bake.spec.max_hours == 2
    (launched,) = [i for r in aws.describe_instances()["Reservations"] for i in r["Instances"]]
    assert "OnBootSec=120min" in user_data(aws, launched["InstanceId"])
    assert "powers off after 2 h at most" in images.bake_question(s)
    nothing_created(aws)
    s.close()


def test_image_ls_shows_pending_and_failed_images_and_up_boots_neither(gpuctl, aws, isolated):
    owner = access.owner_id(isolated)
    pending = add_baked(owner, "2.21", installed="2.21.0", date="2026-11-29", state="pending")
    failed = add_baked(owner, "2.21", installed="2.21.0", date="2026-11-28", state="failed")
    listed = json.loads(gpuctl("image", "ls", "--json").stdout)["images"]
    assert {i["id"]: i["state"] for i in listed} == {pending: "pending", failed: "failed"}
    table = gpuctl("image", "ls").stdout
    assert "pending" in table and "failed" in table and "`up` boots only available images" in table
    assert {i.id: i.state for i, _ in Ledger(isolated).images()} == {pending: "pending", failed: "failed"}
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]


@pytest.mark.parametrize("asked", ["2.21", "2.21.0"])
def test_a_bake_asked_for_2_21_serves_both_2_21_and_the_version_it_installed(gpuctl, aws, isolated, asked):
    mine = add_baked(access.owner_id(isolated), "2.21", installed="2.21.0")
    res = gpuctl(*UP, "--tf", asked)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == mine and "your baked image with TensorFlow 2.21.0" in res.stderr


def test_a_cpu_only_bake_is_skipped_for_a_gpu_type_and_said(gpuctl, aws, isolated):
    owner = access.owner_id(isolated)
    cpu = add_baked(owner, "2.21", installed="2.21.0", variant="cpu", date="2026-11-29")
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]
    line = next(ln for ln in res.stderr.splitlines() if ln.strip().startswith("image "))
    assert f"skipped your CPU-only bake {cpu}: g5.xlarge has a GPU" in line
    gpuctl("down", "-y")
    # A type without a GPU boots it.
    gpuctl(*[a if a != "g5.xlarge" else "c5.xlarge" for a in UP])
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == cpu


def test_a_bake_for_another_base_os_is_not_used(gpuctl, aws, isolated):
    add_baked(access.owner_id(isolated), "2.21", installed="2.21.0", base_os="ubuntu-24.04")
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == NEWEST_X86[0]


def test_a_dlami_for_another_os_is_not_used(gpuctl, aws, isolated, monkeypatch):
    # AWS published TF DLAMIs for Amazon Linux 2023 too: booted with ssh_user ubuntu, it would wait
    # out wait_timeout_s while billing.
    add_dlami("2.21", date="2026-11-28", os_name="Amazon Linux 2023")
    ubuntu = add_dlami("2.21", date="2026-11-20")
    res = gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == ubuntu and "Deep Learning AMI for Ubuntu 22.04" in res.stderr
    gpuctl("down", "-y")
    monkeypatch.setenv("GPUCTL_AWS__BASE_OS", "ubuntu-24.04")  # no 24.04 DLAMI: the 24.04 base image
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["ImageId"] == BASE_AMIS[2][0]


def test_an_image_pattern_without_the_version_is_refused(gpuctl, aws, monkeypatch):
    add_dlami("2.19")
    monkeypatch.setenv("GPUCTL_AWS__IMAGE_PATTERN", "Deep Learning*AMI GPU TensorFlow*")  # an old config's
    res = gpuctl(*UP, code=3)
    assert "has no {tf}" in res.stderr and "Hint: Put {tf} where the version goes" in res.stderr
    nothing_created(aws)


@pytest.mark.parametrize("args", [["image", "ls"], ["image", "rm", "ami-0123456789abcdef0", "-y"]])
def test_provider_aws_on_the_command_line_overrides_the_setting(gpuctl, aws, isolated, monkeypatch, args):
    monkeypatch.setenv("GPUCTL_PROVIDER", "local")
    mine = add_baked(access.owner_id(isolated))
    if args[1] == "ls":
        assert mine in gpuctl(*args, "--provider", "aws").stdout
    else:
        assert "no image ami-0123456789abcdef0 in us-east-1" in gpuctl(*args, "--provider", "aws", code=4).stderr
