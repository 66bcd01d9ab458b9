"""The `ssh` provider: GPU machines the user already has, reached over SSH.

Nothing is rented, so nothing is created but gpuctl's work directory on each host; `down` ends
gpuctl's jobs there (its own tmux server) and leaves the user's files alone. The cluster's hosts
are remembered in a small file under the gpuctl home, the provider's own view for `--all`.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from gpuctl.errors import GpuctlError, RemoteError
from gpuctl.remote import guard
from gpuctl.remote.jobs import kill_server
from gpuctl.remote.ssh import Endpoint, SshHost
from gpuctl.settings import Settings
from gpuctl.types import ClusterSpec, InstanceRecord, Resource

NEEDED = {"tmux": "tmux", "python3": "python3", "tar": "tar"}


def _quiet(_: str) -> None:
    pass


class SshProvider:
    name = "ssh"
    reuses_live_clusters = False

    def __init__(self, home: Path, settings: Settings):
        self.home = Path(home)
        self.settings = settings

    def _registry(self) -> Path:
        return self.home / "ssh-clusters"

    def connect(self, ep: Endpoint, identity: str | None, workdir: str | None = None,
                progress: Callable[[str], None] | None = None, connect_timeout_s: float | None = None) -> SshHost:
        r = self.settings.remote
        return SshHost(ep, self.home, identity, workdir or r.workdir, python=r.python,
                       connect_timeout_s=connect_timeout_s or r.connect_timeout_s, progress=progress)

    def launch(self, spec: ClusterSpec, progress: Callable[[str], None] = _quiet, wait_ssh: bool = True) -> list[InstanceRecord]:
        endpoints = [Endpoint.parse(h) for h in spec.hosts]

        def check(ep: Endpoint) -> InstanceRecord:
            host = self.connect(ep, spec.identity, progress=progress)
            try:
                res = host.run(["sh", "-c", "for t in tmux python3 tar; do command -v $t >/dev/null || echo $t; done"],
                               cwd=False)
                missing = res.stdout.split()
                if missing:
                    raise RemoteError(
                        f"{', '.join(missing)} missing on {ep.label}",
                        f"Install it there: `sudo apt-get install {' '.join(NEEDED[m] for m in missing)}`.",
                    )
                host.run(["mkdir", "-p", host.root], cwd=False)
                progress(f"{ep.label}: reachable, host key pinned, tmux and python3 present, work dir {host.root}")
                return InstanceRecord(
                    id=f"ssh:{ep.label}", cluster=spec.name, state="running", public_ip=ep.host, market="owned",
                    usd_per_hour=spec.usd_per_hour, price_source="ssh.usd_per_hour", launched_at=time.time(),
                    workdir=host.root, ssh_user=ep.user, key_path=spec.identity, port=ep.port,
                )
            finally:
                host.close()

        with ThreadPoolExecutor(max_workers=8) as pool:  # many hosts: checked in parallel
            records = list(pool.map(check, endpoints))
        self._registry().mkdir(parents=True, exist_ok=True)
        (self._registry() / f"{spec.name}.json").write_text(json.dumps([r.model_dump() for r in records]))
        return records

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None) -> SshHost:
        ep = Endpoint(user=instance.ssh_user or "", host=instance.public_ip or "", port=instance.port or 22)
        return self.connect(ep, instance.key_path, instance.workdir, connect_timeout_s=connect_timeout_s)

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        root = self._registry()
        files = [root / f"{cluster}.json"] if cluster else (sorted(root.glob("*.json")) if root.is_dir() else [])
        out = []
        for f in files:
            if f.exists():
                for rec in json.loads(f.read_text()):
                    out.append(Resource(provider="ssh", kind="jobs", id=rec["id"], cluster=f.stem, state="reachable?"))
        return out

    def release(self, resources: list[Resource], progress: Callable[[str], None] = _quiet) -> None:
        by_cluster: dict[str, list[Resource]] = {}
        for r in resources:
            by_cluster.setdefault(r.cluster or "", []).append(r)
        for cluster, items in by_cluster.items():
            path = self._registry() / f"{cluster}.json"
            records = [InstanceRecord.model_validate(x) for x in json.loads(path.read_text())] if path.exists() else []
            for rec in records:
                try:
                    host = self.host(rec)
                except GpuctlError as exc:
                    progress(f"{rec.id}: not reachable, its gpuctl jobs may still run ({exc.message})")
                    continue
                try:
                    guard.uninstall(host)  # the host stays up: its cron entry must not revive the watchdog
                    kill_server(host)  # gpuctl's own tmux server: every gpuctl job there, nothing else
                    progress(f"{rec.id}: gpuctl's jobs ended; its files stay in {rec.workdir}")
                finally:
                    host.close()
            path.unlink(missing_ok=True)
