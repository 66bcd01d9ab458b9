"""The `ssh` provider: GPU machines the user already has, reached over SSH.

Nothing is rented, so nothing is created but the cluster's work directory on each host
(`remote.workdir`/CLUSTER) and its own tmux server: several clusters may share a host, and `down`
of one ends every process of its own server (jobs, their children, TensorBoard, the watchdog) and
nothing of the others', and leaves the user's files alone. The cluster's hosts are remembered in a
small file under the gpuctl home, the provider's own view for `--all`.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpuctl.errors import ConfigError, ConflictError, GpuctlError, RemoteError
from gpuctl.model.endpoint import Endpoint
from gpuctl.model.records import InstanceRecord, Resource
from gpuctl.model.specs import Capabilities, RunFiles, SshSpec
from gpuctl.payloads.gpuctl_protocol import STOP_JOBS
from gpuctl.provision import MachinesThatStay, ignore_launched, refuse_placement, remote_spec
from gpuctl.provision.ssh import volumes
from gpuctl.remote import guard
from gpuctl.remote.host import QUICK_CONNECT_S, Host
from gpuctl.remote.ssh import resolve as ssh_resolve
from gpuctl.remote.ssh.host import SshHost
from gpuctl.remote.teardown import end_cluster

if TYPE_CHECKING:
    from gpuctl.config.settings import Settings
    from gpuctl.provision import Provider

NEEDED = {"tmux": "tmux", "python3": "python3", "tar": "tar"}
RELEASE_CONNECT_TIMEOUT_S = QUICK_CONNECT_S  # one short wait, as every command that ends work (docs/cli.md)


def _quiet(_: str) -> None:
    pass


def _refuse_if_taken(host: SshHost, name: str) -> None:
    """The work dir is this cluster's unless a live cluster of the same name (from another gpuctl
    home: one home's names are unique) still uses it: its watchdog's config is there and its tmux
    server runs. Values read from the host are only passed as quoted arguments."""
    cfg = guard.read_config(host)
    other = cfg.get("tmux_socket")
    if not isinstance(other, str) or not other:
        return
    if host.run(["tmux", "-L", other, "has-session"], check=False, cwd=False).returncode == 0:
        raise ConflictError(f"{host.root} on {host.label} is in use by another live gpuctl cluster named {name!r}",
                            "Pick another --name, or release that cluster from the gpuctl home that started it.")


class SshProvider(MachinesThatStay):
    name = "ssh"
    # The watchdog from `up` on; on fire, the user's own machine ends gpuctl's jobs, never powers off.
    capabilities = Capabilities(arms_guard_at_up=True, default_on_fire=STOP_JOBS)

    def __init__(self, home: Path, spec: SshSpec):
        self.home = Path(home)
        self.spec = spec
        self.remote = spec.remote

    @classmethod
    def spec_from_settings(cls, s: Settings, usd_per_hour: float | None = None) -> SshSpec:
        if not s.ssh.hosts:
            raise ConfigError("the ssh provider needs at least one host",
                              "Pass --host user@host[:port] (repeat it for more), or set `[ssh] hosts`.")
        if s.nodes > 1 and s.nodes != len(s.ssh.hosts):
            raise ConfigError(f"--nodes {s.nodes} with {len(s.ssh.hosts)} --host: on ssh each host is one node",
                              "Pass one --host per node (and leave --nodes out).")
        refuse_placement(s)
        rate = s.ssh.usd_per_hour if usd_per_hour is None else usd_per_hour
        return SshSpec(name=s.cluster, instance_type="ssh", usd_per_hour=rate,
                           hosts=tuple(s.ssh.hosts),
                           # Absolute: later commands may run from another directory.
                           identity=os.path.abspath(os.path.expanduser(s.ssh.identity)) if s.ssh.identity else None, nodes=len(s.ssh.hosts),
                           launch_token=secrets.token_hex(8), max_hours=s.guards.max_hours, remote=remote_spec(s),
                           tensorflow=s.train.tensorflow)

    def check(self) -> None:
        # Launch itself checks each host; a key that is not there fails now, not after retries.
        key = self.spec.identity
        if key and not os.path.isfile(key):
            raise ConfigError(f"--identity {key}: no such file", "Pass the private key you log in with "
                              "(e.g. ~/.ssh/id_ed25519), or leave --identity out to use ssh-agent and ~/.ssh keys.")

    def price_quote(self) -> None:
        return None  # --usd-per-hour only prices reports here: nothing new is billed

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        return instances  # owned machines do not end by themselves

    def set_hard_cap(self, host: Host, hours: float) -> bool:
        return False

    def run_files(self) -> RunFiles:
        return RunFiles(kept="on_hosts")

    def volume_store(self) -> volumes.SshVolumes:
        return volumes.SshVolumes(self.spec, self._connect_to)

    def mount_volume(self, host: Host) -> tuple[str, str]:
        assert self.spec.volume is not None, "only a cluster of `up --volume` mounts one"
        return volumes.mount(host, self.spec.volume)

    def _connect_to(self, name: str, workdir: str, identity: str | None) -> SshHost:
        """A host as --host names it (resolved through the ssh config as `up` does), for volumes."""
        cfg_path = ssh_resolve.config_path(self.remote.ssh_config)
        ep = ssh_resolve.resolve(name, ssh_resolve.load(cfg_path), cfg_path, identity=identity)
        return self.connect(ep, None, workdir, "gpuctl-volumes", connect_timeout_s=RELEASE_CONNECT_TIMEOUT_S)

    def _registry(self) -> Path:
        return self.home / "ssh-clusters"

    def connect(self, ep: Endpoint, identity: str | None, workdir: str, tmux_socket: str,
                progress: Callable[[str], None] | None = None, connect_timeout_s: float | None = None) -> SshHost:
        r = self.remote
        # `ep` carries its jump hosts and their keys; `identity`, when given, is the host's key.
        return SshHost(ep, self.home, identity, workdir, python=r.python, tmux_socket=tmux_socket,
                       command_timeout_s=r.command_timeout_s,
                       connect_timeout_s=connect_timeout_s or r.connect_timeout_s, progress=progress)

    def launch(self, progress: Callable[[str], None] = _quiet, wait_ssh: bool = True,
               launched: Callable[[InstanceRecord], None] = ignore_launched) -> list[InstanceRecord]:
        spec = self.spec
        # Aliases, users, ports, keys and jump hosts from the user's ssh config, resolved once here
        # and recorded: later commands reach the hosts the same way whatever that file says then.
        cfg_path = ssh_resolve.config_path(self.remote.ssh_config)
        cfg = ssh_resolve.load(cfg_path)
        endpoints = [ssh_resolve.resolve(h, cfg, cfg_path, identity=spec.identity) for h in spec.hosts]

        def check(ep: Endpoint) -> InstanceRecord:
            # This `up`'s own work dir and tmux server: other clusters on the host keep theirs.
            host = self.connect(ep, None, posixpath.join(self.remote.workdir, spec.name),
                                f"gpuctl-{secrets.token_hex(5)}", progress=progress)
            try:
                res = host.run(["sh", "-c", "for t in tmux python3 tar; do command -v $t >/dev/null || echo $t; done"],
                               cwd=False)
                missing = res.stdout.split()
                if missing:
                    raise RemoteError(
                        f"{', '.join(missing)} missing on {ep.name}",
                        f"Install it there: `sudo apt-get install {' '.join(NEEDED[m] for m in missing)}`.",
                    )
                _refuse_if_taken(host, spec.name)
                host.run(["mkdir", "-p", host.root], cwd=False)
                progress(f"{ep.name}: reachable, host key pinned, tmux and python3 present, work dir {host.root}")
                return InstanceRecord(
                    id=f"ssh:{ep.label}", cluster=spec.name, state="running", public_ip=ep.host, market="owned",
                    usd_per_hour=spec.usd_per_hour, price_source="ssh.usd_per_hour", launched_at=time.time(),
                    workdir=host.root, ssh_user=ep.user, key_path=ep.identity, port=ep.port,
                    jump_hosts=tuple(h.spec for h in ep.jump), jump_keys=tuple(h.identity or "" for h in ep.jump),
                    tmux_socket=host.tmux_socket,
                )
            finally:
                host.close()

        with ThreadPoolExecutor(max_workers=8) as pool:  # many hosts: checked in parallel
            # Every --host is a node, ranked in the order given (node 0, the chief, first).
            records = [r.model_copy(update={"node": i}) for i, r in enumerate(pool.map(check, endpoints))]
        for record in records:  # in this thread, once every host answered: nothing is started here
            launched(record)
        self.remember(records)
        return records

    def remember(self, instances: list[InstanceRecord]) -> None:
        # What `down --all` and `status --all` find of the cluster, and how they reach it (work dir, socket).
        self._registry().mkdir(parents=True, exist_ok=True)
        (self._registry() / f"{self.spec.name}.json").write_text(json.dumps([r.model_dump() for r in instances]))

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None,
             progress: Callable[[str], None] | None = None) -> SshHost:
        # As recorded at `up` (jump hosts too): the ssh config is not read again.
        return self.connect(Endpoint.from_record(instance), None, instance.workdir, instance.tmux_socket,
                            progress=progress, connect_timeout_s=connect_timeout_s)

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        root = self._registry()
        files = [root / f"{cluster}.json"] if cluster else (sorted(root.glob("*.json")) if root.is_dir() else [])
        out = []
        for f in files:
            if f.exists():
                for rec in json.loads(f.read_text()):
                    out.append(Resource(provider="ssh", kind="jobs", id=rec["id"], cluster=f.stem, state="reachable?"))
        return out

    def release(self, resources: list[Resource], progress: Callable[[str], None] = _quiet,
                unreachable: frozenset[str] = frozenset()) -> None:
        left: list[str] = []
        by_cluster: dict[str, list[Resource]] = {}
        for r in resources:
            by_cluster.setdefault(r.cluster or "", []).append(r)
        for cluster in by_cluster:
            path = self._registry() / f"{cluster}.json"
            records = [InstanceRecord.model_validate(x) for x in json.loads(path.read_text())] if path.exists() else []
            for rec in records:
                if rec.id in unreachable:  # one wait per command: it did not answer a moment ago
                    progress(f"{rec.id}: not reachable, its gpuctl jobs may still run (it did not answer in this command)")
                    continue
                try:
                    # The user's own machine answers at once or not at all: no booting to wait for.
                    host = self.host(rec, connect_timeout_s=min(RELEASE_CONNECT_TIMEOUT_S, self.remote.connect_timeout_s))
                except GpuctlError as exc:
                    progress(f"{rec.id}: not reachable, its gpuctl jobs may still run ({exc.message})")
                    continue
                try:
                    survivors = end_cluster(host)  # this cluster's processes only, nothing of other clusters'
                    if survivors:
                        left.append(f"{rec.id}: {'; '.join(survivors[:3])}")
                    else:
                        progress(f"{rec.id}: no process of the cluster is left; its files stay in {rec.workdir}")
                finally:
                    host.close()
            if not left:
                path.unlink(missing_ok=True)
        if left:
            raise RemoteError(f"processes of the cluster survived SIGKILL on {' | '.join(left)}",
                              "Look at them with `ps` there; run `gpuctl down` again once they are gone.")


if TYPE_CHECKING:
    _keeps_the_contract: type[Provider] = SshProvider  # checked by mypy (scripts/typecheck)
