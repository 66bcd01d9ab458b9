"""Volumes: storage with a name that outlives clusters (`gpuctl volume create`, `up --volume`).

On aws a volume is an EBS gp3 volume (encrypted, tagged like everything gpuctl makes) in one
zone, attached to a cluster's chief and mounted at `/mnt/gpuctl/NAME`; on local and ssh it is a
named directory on the host. The record below is what the VolumeStore contract returns and the
ledger keeps (from the moment the provider gave its id, like an instance).
"""

from __future__ import annotations

import re
from typing import Optional

from gpuctl.errors import ConfigError
from gpuctl.model.specs import Frozen, VolumeUse as VolumeUse  # re-exported: the spec carries it

# gp3's own limits (EC2 refuses a gp3 volume outside 1-16384 GiB).
MIN_GB, MAX_GB = 1, 16384
# Volume names become tags, directory and mount point names: as plain as cluster names.
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
# Where a job finds the volume: the chief's environment has it (docs/data.md).
ENV_VAR = "GPUCTL_VOLUME_DIR"
MOUNT_ROOT = "/mnt/gpuctl"  # aws: the volume NAME is mounted at MOUNT_ROOT/NAME on the chief


class Volume(Frozen):
    """A volume as its provider describes it (and the ledger keeps it)."""

    name: str
    provider: str  # aws, local, ssh
    id: str  # aws: vol-...; local and ssh: the directory on the host
    size_gb: int
    created_at: float
    region: str = ""  # aws
    zone: str = ""  # aws: the availability zone; a cluster using it launches there
    host: str = ""  # ssh: the host it lives on (user@host:port), as --host named it
    identity: Optional[str] = None  # ssh: the key it was made with (later commands reach the host with it)
    path: str = ""  # where a job on the chief finds it ($GPUCTL_VOLUME_DIR)
    usd_per_gb_month: float = 0.0  # aws: gp3's list price; 0 on machines of your own
    attached_to: str = ""  # the provider's word: the instance it is attached to (aws), "" = none
    state: str = "available"  # the provider's word (aws: creating, available, in-use, ...)

    @property
    def usd_per_month(self) -> float:
        return self.size_gb * self.usd_per_gb_month


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ConfigError(f"volume name {name[:60]!r} is not allowed",
                          "Use 1-40 lowercase letters, digits or '-', starting with a letter or digit (e.g. imagenet).")
    return name


def check_size(size_gb: int) -> int:
    if not MIN_GB <= size_gb <= MAX_GB:
        raise ConfigError(f"--size {size_gb} is out of range",
                          f"Give the size in GB, from {MIN_GB} to {MAX_GB} (EBS gp3's limits), e.g. --size 100.")
    return size_gb


def mount_point(name: str) -> str:
    return f"{MOUNT_ROOT}/{check_name(name)}"
