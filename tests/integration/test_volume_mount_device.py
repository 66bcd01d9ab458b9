"""The aws mount script (provision/aws/mount.py) on a real block device: a loop device over a
sparse file, with the real blkid, mkfs.ext4, mount and chown (root). What stays unverified here is
only what EC2 does: the NVMe name the volume shows under (/dev/disk/by-id/...), given here as the
device to look for, and sudo on the instance."""

import os
import subprocess

from gpuctl.provision.aws import mount


def run(dev: str, mount_point: str) -> subprocess.CompletedProcess:
    text = mount.script("vol-0abc", mount_point, "root", "gpuctl-data", devices=[dev], wait_s=2)
    return subprocess.run(["/bin/sh", "-c", text], capture_output=True, text=True, timeout=120)


def test_a_new_device_is_formatted_once_and_its_files_survive_the_next_mount(loop_device, tmp_path):
    dev = loop_device(64)
    where = str(tmp_path / "mnt" / "data")
    first = run(dev, where)
    assert first.returncode == 0 and first.stdout.startswith(f"formatted {dev} (ext4)"), first.stderr
    with open(os.path.join(where, "dataset.txt"), "w") as fh:
        fh.write("fetched once\n")
    assert run(dev, where).stdout.startswith(f"already {where}")  # mounted: nothing more
    subprocess.run(["umount", where], check=True)
    again = run(dev, where)  # the next cluster's chief: a filesystem is there, never formatted again
    assert again.returncode == 0 and again.stdout.startswith(f"mounted {dev} at {where}"), again.stderr
    assert open(os.path.join(where, "dataset.txt")).read() == "fetched once\n"
    subprocess.run(["umount", where], check=True)


def test_a_device_with_a_partition_table_is_never_formatted(loop_device, tmp_path):
    def dos_table(image):
        with open(image, "r+b") as fh:  # an MBR's signature: blkid -p sees a partition table
            fh.seek(510)
            fh.write(b"\x55\xaa")

    dev = loop_device(64, dos_table)
    res = run(dev, str(tmp_path / "mnt" / "data"))
    assert res.returncode == 8 and not res.stdout.startswith("formatted")  # mount refused it, nothing formatted
    assert subprocess.run(["blkid", "-p", "-o", "value", "-s", "PTTYPE", dev], capture_output=True,
                          text=True).stdout.strip() == "dos"
