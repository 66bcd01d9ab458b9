"""The `local` provider: this machine plays the instance.

A cluster is a work directory under the gpuctl home; its jobs run under a tmux server of its own.
Nothing is rented, so `local.usd_per_hour` (default 0) is the price the reports use.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpuctl.errors import RemoteError
from gpuctl.provision import MachinesThatStay, refuse_placement, remote_spec
from gpuctl.remote import guard
from gpuctl.remote.host import Host, LocalHost
from gpuctl.remote.jobs import end_processes, kill_server
from gpuctl.types import ClusterSpec, InstanceRecord, Resource

if TYPE_CHECKING:
    from gpuctl.settings import Settings


NODES_DIR = "nodes"  # a multi-node cluster's nodes 1..N-1, inside node 0's work dir


class LocalProvider(MachinesThatStay):
    name = "local"
    reuses_live_clusters = False
    arms_guard_at_up = False  # nothing is rented: the first `train` arms it
    default_on_fire = "stop-jobs"
    boot_hard_cap = False

    def __init__(self, home: Path, spec: ClusterSpec):
        self.home = Path(home)
        self.spec = spec

    @classmethod
    def spec_from_settings(cls, s: Settings, usd_per_hour: float | None = None) -> ClusterSpec:
        refuse_placement(s)
        rate = s.local.usd_per_hour if usd_per_hour is None else usd_per_hour
        return ClusterSpec(name=s.cluster, provider=cls.name, usd_per_hour=rate, launch_token=secrets.token_hex(8),
                           nodes=s.nodes,
                           max_hours=s.guards.max_hours, remote=remote_spec(s), tensorflow=s.train.tensorflow)

    def check(self) -> None:
        pass  # this machine is here

    def launch_question(self) -> str | None:
        if self.spec.usd_per_hour <= 0:
            return None
        n = self.spec.nodes
        nodes = f" ({n} nodes at ${self.spec.usd_per_hour:,.4f}/h each)" if n > 1 else ""
        return f"start local cluster {self.spec.name!r} billed at ${self.spec.usd_per_hour * n:,.4f}/h{nodes}"

    def _clusters_dir(self) -> Path:
        return self.home / "clusters"

    def launch(self, progress: Callable[[str], None] = lambda _: None, wait_ssh: bool = True) -> list[InstanceRecord]:
        spec = self.spec
        workdir = self._clusters_dir() / spec.name
        records = []
        for node in range(spec.nodes):
            # Node 0 works where a one-machine cluster does; the others beside it, each with its own
            # work dir and so its own tmux server, as separate machines would have.
            root = workdir if node == 0 else workdir / NODES_DIR / str(node)
            root.mkdir(parents=True, exist_ok=True)
            records.append(InstanceRecord(
                id=f"local-{spec.name}-{secrets.token_hex(3)}", node=node, cluster=spec.name, state="running",
                public_ip="127.0.0.1", private_ip="127.0.0.1", market="on-demand", usd_per_hour=spec.usd_per_hour,
                price_source="local.usd_per_hour", launched_at=time.time(), workdir=str(root),
            ))
        return records

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None) -> LocalHost:
        return LocalHost(Path(instance.workdir))

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        return instances  # this machine runs while gpuctl does

    def set_hard_cap(self, host: Host, hours: float) -> bool:
        return False

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        root = self._clusters_dir()
        dirs = [root / cluster] if cluster else (sorted(root.iterdir()) if root.is_dir() else [])
        # A multi-node cluster's other nodes first: released before the dir that holds theirs.
        return [
            Resource(provider="local", kind="workdir", id=str(w), cluster=d.name, state="running")
            for d in dirs if d.is_dir()
            for w in (*sorted(p for p in (d / NODES_DIR).glob("*") if p.is_dir()), d)
        ]

    def release(self, resources: list[Resource], progress: Callable[[str], None] = lambda _: None) -> None:
        for r in resources:
            if r.kind == "workdir":
                host = LocalHost(Path(r.id))
                guard.uninstall(host)  # its cron entry, if any, must not revive it
                kill_server(host)  # ends every job of the cluster
                # ...and what outlived its server: daemons a job started, TensorBoard (Linux: /proc)
                survivors = end_processes(host)
                if survivors:
                    raise RemoteError(f"processes of cluster {r.cluster} survived SIGKILL: {'; '.join(survivors[:3])}",
                                      "Look at them with `ps`; run `gpuctl down` again once they are gone.")
                shutil.rmtree(r.id, ignore_errors=True)
                progress(f"removed {r.id}")
