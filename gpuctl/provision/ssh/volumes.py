"""Volumes of the ssh provider: a named directory on one of the user's hosts,
`remote.workdir/_volumes/NAME` (a name no cluster can have: cluster names start with a letter or
digit), which outlives every cluster that uses it (`down` never deletes a host's files). A cluster
uses it when that host is its first --host (the chief)."""

from __future__ import annotations

import posixpath
import time
from typing import Callable

from gpuctl.errors import ConfigError, ConflictError
from gpuctl.model.specs import SshSpec
from gpuctl.model.volumes import Volume, VolumeUse, check_name
from gpuctl.remote.host import Host

VOLUMES_DIR = "_volumes"
Connect = Callable[[str, str, "str | None"], Host]  # (--host as given, work dir, key) -> a connected Host


class SshVolumes:
    provider = "ssh"
    region = ""
    usd_per_gb_month = 0.0  # the user's own disk
    lists_its_own = False  # the ledger's record is the volume

    def __init__(self, spec: SshSpec, connect: Connect):
        self.spec = spec
        self.connect = connect

    def _dir(self, name: str) -> str:
        return posixpath.join(self.spec.remote.workdir, VOLUMES_DIR, check_name(name))

    def where(self, zone: str | None) -> str:
        if zone:
            raise ConfigError(f"--zone {zone}: an ssh volume is a directory on your host, which has no zones",
                              "Leave --zone out.")
        if not self.spec.hosts:
            raise ConfigError("an ssh volume needs the host it lives on", "Pass --host user@host[:port].")
        return self.spec.hosts[0]

    def create(self, name: str, size_gb: int, where: str, created: Callable[[Volume], None]) -> Volume:
        host = self.connect(where, self._dir(name), self.spec.identity)
        try:
            if host.run(["test", "-e", host.root], check=False, cwd=False).returncode == 0:
                raise ConflictError(f"{host.root} exists already on {where}", "Pick another name.")
            host.run(["mkdir", "-p", "-m", "700", host.root], cwd=False)
            volume = Volume(name=name, provider="ssh", id=host.root, path=host.root, host=where, size_gb=size_gb,
                            created_at=time.time(), identity=self.spec.identity)
        finally:
            host.close()
        created(volume)
        return volume

    def volumes(self) -> list[Volume]:
        return []  # lists_its_own is False: the ledger's records are asked instead

    def describe(self, volume: Volume) -> Volume | None:
        host = self.connect(volume.host, volume.id, volume.identity or self.spec.identity)
        try:
            there = host.run(["test", "-d", volume.id], check=False, cwd=False).returncode == 0
        finally:
            host.close()
        return volume if there else None

    def use(self, volume: Volume) -> VolumeUse:
        chief = self.spec.hosts[0] if self.spec.hosts else ""
        if volume.host != chief:
            raise ConfigError(f"volume {volume.name!r} is on {volume.host}; this cluster's first --host is {chief}",
                              f"Put {volume.host} first (--host {volume.host} ...): the volume is the chief's.")
        return VolumeUse(name=volume.name, id=volume.id, path=volume.path, host=volume.host)

    def remove(self, volume: Volume, progress: Callable[[str], None]) -> None:
        if posixpath.basename(posixpath.dirname(volume.id)) != VOLUMES_DIR:  # the ledger's word, checked
            raise ConfigError(f"{volume.id} is not a gpuctl volume directory", "Remove it by hand if it is yours.")
        host = self.connect(volume.host, volume.id, volume.identity or self.spec.identity)
        try:
            host.run(["rm", "-rf", "--", volume.id], cwd=False)
        finally:
            host.close()
        progress(f"removed {volume.id} on {volume.host}")


def mount(host: Host, use: VolumeUse) -> tuple[str, str]:
    """The directory on the chief, made again if someone removed it."""
    host.run(["mkdir", "-p", "-m", "700", use.id], cwd=False)
    return use.path, f"directory {use.path} on {use.host}"
