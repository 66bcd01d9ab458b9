"""The instance side of `up --volume` on aws (provision/aws/mount.py): the real script, run by a
real /bin/sh, against stand-in commands (mountpoint, findmnt, blkid, mkfs.ext4, mount, chown,
mkdir, sleep) that record how they were called, and a plain file standing in for the device.

Stand-ins, so that every branch (a device that cannot be probed, one mounted elsewhere, none
after the wait) runs in the fast tier without root; tests/integration/test_volume_mount_device.py
runs the same script on a real loop device with the real commands (root). That the EBS volume
shows up under the names `candidates` lists is verifiable only on real EC2."""

from __future__ import annotations

import os
import subprocess

import pytest

from gpuctl.provision.aws import mount

STUBS = {
    "mountpoint": 'echo "mountpoint $*" >> "$LOG"; exit "${MOUNTPOINT_RC:-1}"',
    "findmnt": 'echo "findmnt $*" >> "$LOG"; exit "${FINDMNT_RC:-1}"',
    "blkid": 'echo "blkid $*" >> "$LOG"; exit "${BLKID_RC:-2}"',
    "mkfs.ext4": 'echo "mkfs.ext4 $*" >> "$LOG"',
    "mount": 'echo "mount $*" >> "$LOG"',
    "chown": 'echo "chown $*" >> "$LOG"',
    "mkdir": 'echo "mkdir $*" >> "$LOG"',
    "sleep": 'echo "sleep $*" >> "$LOG"',
}


@pytest.fixture
def instance(tmp_path):
    """Run the script as the chief would, against the stand-ins; (exit code, stdout, calls)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in STUBS.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    device = tmp_path / "nvme1n1"
    device.write_text("")
    log = tmp_path / "calls"

    def run(mount_point="/mnt/gpuctl/data", devices=None, **rcs):
        log.write_text("")
        text = mount.script("vol-0abc", mount_point, "ubuntu", "gpuctl-data",
                            devices=[str(device)] if devices is None else devices, wait_s=2)
        env = {"PATH": f"{bin_}:/usr/bin:/bin", "LOG": str(log), **{k.upper(): str(v) for k, v in rcs.items()}}
        res = subprocess.run(["/bin/sh", "-c", text], env=env, capture_output=True, text=True, timeout=30)
        return res.returncode, res.stdout + res.stderr, log.read_text().splitlines(), str(device)

    return run


def test_a_new_volume_is_formatted_once_and_mounted(instance):
    rc, out, calls, dev = instance(blkid_rc=2)  # blkid -p: nothing identifiable on it
    assert rc == 0 and out.startswith(f"formatted {dev} (ext4), mounted at /mnt/gpuctl/data"), out
    assert f"mkfs.ext4 -q -m 0 -L gpuctl-data {dev}" in calls
    assert calls[-3:] == ["mkdir -p /mnt/gpuctl/data", f"mount -o noatime {dev} /mnt/gpuctl/data",
                          "chown ubuntu: /mnt/gpuctl/data"]


def test_a_volume_with_a_filesystem_is_never_formatted(instance):
    rc, out, calls, dev = instance(blkid_rc=0)  # blkid -p found something (a filesystem, a partition table)
    assert rc == 0 and out.startswith(f"mounted {dev} at /mnt/gpuctl/data"), out
    assert not [c for c in calls if c.startswith("mkfs")]
    assert f"mount -o noatime {dev} /mnt/gpuctl/data" in calls


@pytest.mark.parametrize("blkid_rc", [1, 4, 8])
def test_a_device_that_cannot_be_probed_is_neither_formatted_nor_mounted(instance, blkid_rc):
    rc, out, calls, _ = instance(blkid_rc=blkid_rc)
    assert rc == 6 and "not formatting it" in out
    assert not [c for c in calls if c.startswith(("mkfs", "mount "))]


def test_mounted_already_does_nothing_more(instance):
    rc, out, calls, _ = instance(mountpoint_rc=0)
    assert rc == 0 and out.startswith("already /mnt/gpuctl/data") and calls == ["mountpoint -q /mnt/gpuctl/data"]


def test_a_device_mounted_elsewhere_is_left_alone(instance):
    rc, out, calls, dev = instance(findmnt_rc=0)
    assert rc == 4 and f"{dev} is mounted elsewhere" in out
    assert not [c for c in calls if c.startswith(("blkid", "mkfs", "mount "))]


def test_no_device_after_the_wait_is_an_error_that_formats_nothing(instance, tmp_path):
    rc, out, calls, _ = instance(devices=[str(tmp_path / "absent")])
    assert rc == 3 and "no device for volume vol-0abc after 2 s" in out
    assert calls.count("sleep 1") == 3 and not [c for c in calls if c.startswith(("blkid", "mkfs", "mount "))]


def test_every_value_reaches_the_commands_as_one_word(instance):
    odd = "/mnt/gpuctl/a b; touch $(echo pwned)"
    rc, out, calls, dev = instance(mount_point=odd, blkid_rc=0)
    assert rc == 0 and f"mount -o noatime {dev} {odd}" in calls and not os.path.exists("pwned")


def test_the_device_is_looked_for_by_the_volume_id_nitro_then_xen():
    found = mount.candidates("vol-0123456789abcdef0")
    assert found[0] == "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
    assert found[-2:] == ["/dev/xvdf", "/dev/sdf"] and mount.DEVICE == "/dev/sdf"
    assert mount.argv("vol-1", "/mnt/gpuctl/x", "ubuntu", "gpuctl-x")[:4] == ["sudo", "-n", "sh", "-c"]
    assert mount.argv("vol-1", "/mnt/gpuctl/x", "root", "gpuctl-x")[:2] == ["sh", "-c"]  # root: no sudo needed
