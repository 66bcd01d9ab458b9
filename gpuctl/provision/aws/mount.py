"""The instance side of `up --volume` on aws: find the attached EBS volume's device, format it
(ext4) only if it holds nothing at all, mount it at /mnt/gpuctl/NAME, and say what it did.

It is one POSIX shell script, built here with every value quoted and run as root on the chief
over SSH (`sudo -n sh -c SCRIPT`). What it does is decided on the instance by `blkid -p`, the
low-level probe that reads the device itself: exit 0 = something is there (a filesystem, a
partition table, a RAID member...: never formatted), 2 = nothing identifiable (a new volume:
formatted once), anything else = cannot tell (nothing is formatted; the mount fails, named).

tests/unit/test_volume_mount.py runs this script against stand-in commands (each branch), and
tests/integration/test_volume_mount_device.py on a real loop device with the real blkid, mkfs and
mount (root). What only a real EC2 instance can show: that the attached volume appears under the
names `candidates` lists (moto attaches nothing), and sudo there.
"""

from __future__ import annotations

import shlex

DEVICE = "/dev/sdf"  # the name AttachVolume is given; Nitro instances show it as NVMe (by-id below)
WAIT_DEVICE_S = 60  # the device appears a few seconds after AttachVolume says attached
# The script's last line, one of these words first: what `mount_volume` reports.
DONE = ("mounted", "formatted", "already")


def candidates(volume_id: str) -> list[str]:
    """Where the device shows: on Nitro (every current GPU type) udev's by-id link carries the
    volume id without its dash; on Xen the attach name, as xvdf."""
    vol = volume_id.replace("-", "")
    return [f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{vol}", f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{vol}-ns-1",
            "/dev/xvdf", DEVICE]


def script(volume_id: str, mount_point: str, owner: str, label: str, devices: list[str] | None = None,
           wait_s: int = WAIT_DEVICE_S) -> str:
    q = shlex.quote
    found = " ".join(q(d) for d in (devices if devices is not None else candidates(volume_id)))
    return f"""set -u
mp={q(mount_point)}
if mountpoint -q "$mp"; then echo "already $mp"; exit 0; fi
dev=""
i=0
while [ -z "$dev" ] && [ "$i" -le {int(wait_s)} ]; do
  for d in {found}; do
    if [ -e "$d" ]; then dev=$(readlink -f "$d"); break; fi
  done
  [ -n "$dev" ] || {{ i=$((i + 1)); sleep 1; }}
done
if [ -z "$dev" ]; then echo "no device for volume {volume_id} after {int(wait_s)} s" >&2; exit 3; fi
if findmnt -rn -S "$dev" >/dev/null 2>&1; then echo "$dev is mounted elsewhere" >&2; exit 4; fi
blkid -p "$dev" >/dev/null 2>&1
probe=$?
made=""
if [ "$probe" -eq 2 ]; then
  mkfs.ext4 -q -m 0 -L {q(label[:16])} "$dev" || exit 5
  made=1
elif [ "$probe" -ne 0 ]; then
  echo "cannot tell what $dev holds (blkid -p exit $probe): not formatting it" >&2; exit 6
fi
mkdir -p "$mp" || exit 7
mount -o noatime "$dev" "$mp" || exit 8
chown {q(owner)}: "$mp" || exit 9
if [ -n "$made" ]; then echo "formatted $dev (ext4), mounted at $mp"; else echo "mounted $dev at $mp"; fi
"""


def argv(volume_id: str, mount_point: str, owner: str, label: str, devices: list[str] | None = None) -> list[str]:
    """The command the chief runs as root: through sudo (the login user of EC2's images has it,
    without a password); an image whose login user is root needs none (and may not have it)."""
    run_as_root = [] if owner == "root" else ["sudo", "-n"]
    return [*run_as_root, "sh", "-c", script(volume_id, mount_point, owner, label, devices)]
