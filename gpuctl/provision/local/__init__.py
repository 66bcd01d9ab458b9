"""The `local` provider: this machine plays the instance.

A cluster is a work directory under the gpuctl home; its jobs run under a tmux server of its own.
Nothing is rented, so `local.usd_per_hour` (default 0) is the price the reports use.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path

from gpuctl.remote.host import LocalHost
from gpuctl.remote.jobs import kill_server
from gpuctl.settings import Settings
from gpuctl.types import ClusterSpec, InstanceRecord


class LocalProvider:
    name = "local"

    def __init__(self, home: Path):
        self.home = Path(home)

    def workdir(self, cluster: str) -> Path:
        return self.home / "clusters" / cluster

    def launch(self, spec: ClusterSpec, settings: Settings) -> list[InstanceRecord]:
        workdir = self.workdir(spec.name)
        workdir.mkdir(parents=True, exist_ok=True)
        return [
            InstanceRecord(
                id=f"local-{spec.name}-{secrets.token_hex(3)}",
                cluster=spec.name,
                state="running",
                public_ip="127.0.0.1",
                market="on-demand",
                usd_per_hour=spec.usd_per_hour,
                launched_at=time.time(),
                workdir=str(workdir),
            )
        ]

    def host(self, instance: InstanceRecord) -> LocalHost:
        return LocalHost(Path(instance.workdir))

    def terminate(self, instances: list[InstanceRecord]) -> None:
        for inst in instances:
            kill_server(self.host(inst))
            shutil.rmtree(inst.workdir, ignore_errors=True)
