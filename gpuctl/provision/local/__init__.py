"""The `local` provider: this machine plays the instance.

A cluster is a work directory under the gpuctl home; its jobs run under a tmux server of its own.
Nothing is rented, so `local.usd_per_hour` (default 0) is the price the reports use. Releasing a
cluster keeps each run's directory (outputs, checkpoints, log, reports) under the home's `runs/`
(0700): work is never deleted by `down`, only by `gpuctl runs rm`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpuctl.errors import RemoteError
from gpuctl.model.records import InstanceRecord, PriceQuote, Resource
from gpuctl.model.specs import Capabilities, LocalSpec, RunFiles
from gpuctl.payloads.gpuctl_protocol import STOP_JOBS
from gpuctl.provision import MachinesThatStay, ignore_launched, refuse_placement, remote_spec
from gpuctl.provision.local import volumes
from gpuctl.remote.host import Host
from gpuctl.remote.local import LocalHost
from gpuctl.remote.teardown import end_cluster

if TYPE_CHECKING:
    from gpuctl.config.settings import Settings
    from gpuctl.provision import Provider


NODES_DIR = "nodes"  # a multi-node cluster's nodes 1..N-1, inside node 0's work dir
KEPT_RUNS_DIR = "runs"  # under the gpuctl home: runs of released clusters, one directory each


class LocalProvider(MachinesThatStay):
    name = "local"
    capabilities = Capabilities(default_on_fire=STOP_JOBS)  # nothing is rented: the first `train` arms the watchdog

    def __init__(self, home: Path, spec: LocalSpec):
        self.home = Path(home)
        self.spec = spec

    @classmethod
    def spec_from_settings(cls, s: Settings, usd_per_hour: float | None = None) -> LocalSpec:
        refuse_placement(s)
        rate = s.local.usd_per_hour if usd_per_hour is None else usd_per_hour
        return LocalSpec(name=s.cluster, usd_per_hour=rate, launch_token=secrets.token_hex(8),
                           nodes=s.nodes,
                           max_hours=s.guards.max_hours, remote=remote_spec(s), tensorflow=s.train.tensorflow)

    def check(self) -> None:
        pass  # this machine is here

    def price_quote(self) -> PriceQuote | None:
        rate = self.spec.usd_per_hour
        if rate <= 0:
            return None
        return PriceQuote(usd_per_hour=rate * self.spec.nodes, nodes=self.spec.nodes, source="local.usd_per_hour")

    def _clusters_dir(self) -> Path:
        return self.home / "clusters"

    def launch(self, progress: Callable[[str], None] = lambda _: None, wait_ssh: bool = True,
               launched: Callable[[InstanceRecord], None] = ignore_launched) -> list[InstanceRecord]:
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
            launched(records[-1])
        return records

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None,
             progress: Callable[[str], None] | None = None) -> LocalHost:
        return LocalHost(Path(instance.workdir), self.spec.remote.command_timeout_s)

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        return instances  # this machine runs while gpuctl does

    def set_hard_cap(self, host: Host, hours: float) -> bool:
        return False

    def volume_store(self) -> volumes.LocalVolumes:
        return volumes.LocalVolumes(self.home)

    def mount_volume(self, host: Host) -> tuple[str, str]:
        assert self.spec.volume is not None, "only a cluster of `up --volume` mounts one"
        return volumes.mount(self.spec.volume)

    def _kept_dir(self) -> Path:
        return self.home / KEPT_RUNS_DIR

    def kept_run(self, run_id: str) -> tuple[Host, str] | None:
        path = self._kept_dir() / run_id
        if "/" in run_id or run_id in ("", ".", "..") or not path.is_dir():
            return None
        return LocalHost(self._kept_dir(), self.spec.remote.command_timeout_s), str(path)

    def run_files(self) -> RunFiles:
        return RunFiles(kept="here", where=str(self._kept_dir()))

    def _keep_runs(self, workdir: Path, progress: Callable[[str], None]) -> None:
        """Move the chief's run directories out of a work dir about to go (the other nodes'
        checkpoints are the chief's). A run kept already (resumed elsewhere since) gives way to
        this copy: a run lives on one cluster at a time, so the cluster going now has its latest."""
        runs = workdir / "runs"
        if not runs.is_dir():
            return
        kept = self._kept_dir()
        kept.mkdir(mode=0o700, parents=True, exist_ok=True)
        for run in sorted(runs.iterdir()):
            if run.is_symlink() or not run.is_dir():
                continue
            for copy in ("code", "data"):  # the run's links to the pushed trees go with them (docs/training.md)
                shutil.rmtree(run / copy, ignore_errors=True)
            dest = kept / run.name
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            os.rename(run, dest)
            os.chmod(dest, 0o700)
            progress(f"kept run {run.name} in {dest}")

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        root = self._clusters_dir()
        dirs = [root / cluster] if cluster else (sorted(root.iterdir()) if root.is_dir() else [])
        # A multi-node cluster's other nodes first: released before the dir that holds theirs.
        return [
            Resource(provider="local", kind="workdir", id=str(w), cluster=d.name, state="running")
            for d in dirs if d.is_dir()
            for w in (*sorted(p for p in (d / NODES_DIR).glob("*") if p.is_dir()), d)
        ]

    def release(self, resources: list[Resource], progress: Callable[[str], None] = lambda _: None,
                unreachable: frozenset[str] = frozenset()) -> None:
        for r in resources:
            if r.kind == "workdir":
                host = LocalHost(Path(r.id), self.spec.remote.command_timeout_s)
                # Every job of the cluster, and what outlived its server: daemons, TensorBoard (/proc)
                survivors = end_cluster(host)
                if survivors:
                    raise RemoteError(f"processes of cluster {r.cluster} survived SIGKILL: {'; '.join(survivors[:3])}",
                                      "Look at them with `ps`; run `gpuctl down` again once they are gone.")
                if r.cluster is not None and Path(r.id) == self._clusters_dir() / r.cluster:  # node 0's (the chief's) work dir
                    self._keep_runs(Path(r.id), progress)
                shutil.rmtree(r.id, ignore_errors=True)
                progress(f"removed {r.id}")


if TYPE_CHECKING:
    _keeps_the_contract: type[Provider] = LocalProvider  # checked by mypy (scripts/typecheck)
