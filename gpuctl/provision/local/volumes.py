"""Volumes of the local provider: a named directory under the gpuctl home (`volumes/NAME`, 0700),
which outlives every cluster that uses it (`down` removes a cluster's work dir, never this)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from gpuctl.errors import ConfigError, ConflictError
from gpuctl.model.volumes import Volume, VolumeUse, check_name

VOLUMES_DIR = "volumes"


class LocalVolumes:
    provider = "local"
    region = ""
    usd_per_gb_month = 0.0  # this machine's own disk
    lists_its_own = False  # the ledger's record is the volume

    def __init__(self, home: Path):
        self.root = Path(home) / VOLUMES_DIR

    def _dir(self, name: str) -> Path:
        return self.root / check_name(name)

    def where(self, zone: str | None) -> str:
        if zone:
            raise ConfigError(f"--zone {zone}: a local volume is a directory on this machine, which has no zones",
                              "Leave --zone out (or create it with --provider aws).")
        return ""

    def create(self, name: str, size_gb: int, where: str, created: Callable[[Volume], None]) -> Volume:
        path = self._dir(name)
        if path.exists():
            raise ConflictError(f"{path} exists already", "Pick another name, or remove that directory if it is not "
                                                          "yours to keep.")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        volume = Volume(name=name, provider="local", id=str(path), path=str(path), size_gb=size_gb,
                        created_at=time.time())
        created(volume)
        return volume

    def volumes(self) -> list[Volume]:
        return []  # lists_its_own is False: the ledger's records are asked instead

    def describe(self, volume: Volume) -> Volume | None:
        return volume if Path(volume.id).is_dir() else None

    def use(self, volume: Volume) -> VolumeUse:
        return VolumeUse(name=volume.name, id=volume.id, path=volume.path)

    def remove(self, volume: Volume, progress: Callable[[str], None]) -> None:
        path = Path(volume.id)
        if path.parent != self.root:  # the ledger's word, checked: nothing outside volumes/ is deleted
            raise ConfigError(f"{path} is not under {self.root}", "Remove it by hand if it is yours.")
        shutil.rmtree(path, ignore_errors=True)
        progress(f"removed {path}")


def mount(use: VolumeUse) -> tuple[str, str]:
    """The directory, made again if someone removed it (an empty volume, as a new one)."""
    Path(use.id).mkdir(mode=0o700, parents=True, exist_ok=True)
    return use.path, f"directory {use.path}"
