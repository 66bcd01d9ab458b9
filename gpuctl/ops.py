"""Use cases: up, train, status, logs, cost, down, config. Typed results, no printing.

Every use case checks its inputs before it creates or destroys anything, so a bad input leaves the
ledger and the instances exactly as they were.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
import shlex
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from pydantic import ValidationError

from gpuctl import billing
from gpuctl.errors import ConfigError, ConflictError, GpuctlError, NoClusterError, NotFoundError, ProjectError, RemoteError
from gpuctl.provision import PROVIDERS, Provider, get_provider
from gpuctl.remote import guard, jobs, preflight
from gpuctl.remote.host import Host
from gpuctl.settings import LoadedSettings, Settings, load_settings
from gpuctl.state import Ledger
from gpuctl.types import (
    FINAL_RUN_STATES,
    ClusterCost,
    ClusterRecord,
    ClusterSpec,
    ClusterStatus,
    CostReport,
    DownResult,
    EpochReport,
    EpochRow,
    ExecResult,
    GuardReport,
    InstanceRecord,
    Inventory,
    PullResult,
    Resource,
    RunCost,
    RunRecord,
    RunStatus,
    SettingValue,
    SshConfigResult,
    StatusReport,
    SyncResult,
    SyncStats,
    TrainResult,
    UpResult,
)

PAYLOAD_DIR = Path(__file__).parent / "payloads"
LAUNCHER = "gpuctl_run.py"
STATUS_CONNECT_TIMEOUT_S = 5.0  # `status` must answer even when an instance does not
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:24] or "run"


class Gpuctl:
    """The use cases over one gpuctl home (ledger + cluster files) and one set of flags."""

    def __init__(self, home: Path, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        self.home = Path(home)
        self.flags = dict(flags or {})
        self.env = os.environ if env is None else env
        self._ledger: Ledger | None = None
        self._open_hosts: dict[str, Host] = {}
        self._settings: dict[tuple[str, str], LoadedSettings] = {}

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.home)
        return self._ledger

    def settings(self, project_dir: Path | None = None) -> LoadedSettings:
        """The settings for this command (cached: a command asks often, files and flags stay put)."""
        key = (json.dumps(self.flags, sort_keys=True, default=str), str(project_dir))
        if key not in self._settings:
            self._settings[key] = load_settings(self.flags, project_dir=project_dir, env=self.env)
        return self._settings[key]

    def _provider(self, name: str, settings: Settings | None = None) -> Provider:
        return get_provider(name, self.home, settings or self.settings().settings)

    def _host(self, cluster: ClusterRecord) -> tuple[InstanceRecord, Host]:
        """The cluster's first instance and a Host for it; one connection per command, reused."""
        return self._hosts(cluster)[0]

    def _hosts(self, cluster: ClusterRecord, connect_timeout_s: float | None = None) -> list[tuple[InstanceRecord, Host]]:
        instances = self.ledger.instances(cluster.name)
        if not instances:
            raise RemoteError(f"cluster {cluster.name!r} has no instance", "Run `gpuctl down` then `gpuctl up`.")
        provider = None
        out = []
        for inst in instances:
            if inst.id not in self._open_hosts:
                provider = provider or self._provider(cluster.provider)
                self._open_hosts[inst.id] = provider.host(inst, connect_timeout_s)
            out.append((inst, self._open_hosts[inst.id]))
        return out

    def close(self) -> None:
        """Close the connections this command opened."""
        for host in self._open_hosts.values():
            close = getattr(host, "close", None)
            if close:
                close()
        self._open_hosts.clear()

    # --- config ---------------------------------------------------------------------------------

    def config(self) -> list[SettingValue]:
        return self.settings().values()

    # --- up -------------------------------------------------------------------------------------

    def up(self, progress: Progress = _quiet, wait_ssh: bool = True) -> UpResult:
        """Create the cluster named by the `cluster` setting (or find and reuse it) and make it the default."""
        s = self.settings().settings
        provider = self._provider(s.provider, s)
        spec = cluster_spec(s)
        live = self.ledger.live_cluster(s.cluster)
        if live is not None:
            if not provider.reuses_live_clusters or live.provider != s.provider:
                raise ConflictError(
                    f"a cluster named {s.cluster!r} is already up",
                    f"Use it (`gpuctl train --cluster {s.cluster} ...`), pick another --name, or `gpuctl down {s.cluster}`.",
                )
            asked = spec.model_dump(exclude={"launch_token"})
            have = live.spec.model_dump(exclude={"launch_token"})
            if asked != have:
                diff = ", ".join(f"{k}: {have[k]} -> {asked[k]}" for k in asked if asked[k] != have[k])
                raise ConflictError(
                    f"cluster {s.cluster!r} is up with other settings ({diff})",
                    f"`gpuctl down {s.cluster} -y` first, or pick another --name.",
                )
            cluster = live
            spec = live.spec  # same launch token: a retried launch cannot start a second instance
        else:
            try:
                # Recorded before launching, so a launch killed half-way is still known locally too.
                cluster = self.ledger.add_cluster(spec)
            except sqlite3.IntegrityError:
                raise ConflictError(f"a cluster named {s.cluster!r} is already up") from None
        try:
            instances = provider.launch(spec, progress, wait_ssh)
        except BaseException:
            if live is None:
                self._close_if_nothing_exists(provider, spec)
            raise
        known = {i.id: i for i in self.ledger.instances(spec.name)} if live is not None else {}
        for n, inst in enumerate(instances):
            if inst.id in known:  # reused: the price and launch time recorded at launch stay
                old = known[inst.id]
                inst = inst.model_copy(update={"usd_per_hour": old.usd_per_hour, "price_source": old.price_source,
                                               "launched_at": old.launched_at})
                instances[n] = inst
            self.ledger.put_instance(inst)
        self.ledger.event("up", f"{len(instances)} instance(s) via {s.provider}", cluster=spec.name)
        if s.provider != "local" and wait_ssh:
            progress(f"watchdog: {self._install_guard(self.settings(), cluster)}")
        elif s.provider != "local":
            progress("watchdog: armed by the first `gpuctl train` (the boot-time hard cap is armed already)")
        return UpResult(cluster=cluster, instances=tuple(instances), reused=live is not None)

    def _close_if_nothing_exists(self, provider: Provider, spec: ClusterSpec) -> None:
        """After a failed launch, drop the ledger's cluster unless the provider holds something of it
        (then it stays up, so `gpuctl down` and `status` still see it)."""
        try:
            leftovers = provider.discover(spec.name, spec.region)
        except ConfigError:
            leftovers = []  # e.g. an unknown region: nothing can exist there
        except GpuctlError:
            return  # cannot tell: keep the record, `down` will sort it out
        if not leftovers:
            self.ledger.mark_cluster_down(spec.name)

    def resolve_cluster(self, name: str | None) -> ClusterRecord:
        """The named live cluster, else the default, else the only one; errors say which to pick."""
        if name:
            found = self.ledger.live_cluster(name)
            if found is None:
                live = [c.name for c in self.ledger.clusters(include_down=False)]
                raise NotFoundError(
                    f"no cluster named {name!r} is up",
                    f"Clusters up: {', '.join(live)}." if live else "Start one with `gpuctl up`.",
                )
            return found
        default = self.ledger.default_cluster()
        if default:
            return default
        live = self.ledger.clusters(include_down=False)
        if len(live) == 1:
            return live[0]
        if not live:
            raise NoClusterError("no cluster is up")
        raise ConflictError(
            f"several clusters are up ({', '.join(c.name for c in live)}) and none is the default",
            "Name one with --cluster.",
        )

    # --- train ----------------------------------------------------------------------------------

    def _project(self, project: Path) -> Path:
        project = Path(project)
        if not project.is_dir():
            raise ProjectError(
                f"project directory {str(project)!r} does not exist" if not project.exists()
                else f"{str(project)!r} is not a directory",
                "Pass the directory that holds your training script, e.g. `gpuctl train examples/cifar10`.",
            )
        return project.resolve()

    def _data_dir(self, data: Path | None) -> Path | None:
        if data is None:
            return None
        if not Path(data).is_dir():
            raise ProjectError(f"data directory {str(data)!r} does not exist",
                               "Pass --data DIR with a directory of training data, or leave it out.")
        return Path(data).resolve()

    def _push(self, host: Host, project: Path, data: Path | None) -> tuple[SyncStats, SyncStats | None, str, str | None]:
        """Push code and (separately, so a code push never touches it) data; their remote dirs."""
        code_dir = posixpath.join(host.root, "code", _slug(project.name))
        code = host.push(project, code_dir)
        if data is None:
            return code, None, code_dir, None
        data_dir = posixpath.join(host.root, "data", _slug(data.name))
        return code, host.push(data, data_dir), code_dir, data_dir

    def sync(self, project: Path, cluster: str | None = None, data: Path | None = None) -> SyncResult:
        """Push the project (and data) to the cluster's first host without starting anything."""
        project, data = self._project(project), self._data_dir(data)
        _, host = self._host(self.resolve_cluster(cluster))
        code, data_stats, code_dir, data_dir = self._push(host, project, data)
        return SyncResult(code=code, data=data_stats, code_dir=code_dir, data_dir=data_dir)

    def train(self, project: Path, cluster: str | None = None, args: tuple[str, ...] = (), data: Path | None = None,
              allow_cpu: bool = False, progress: Progress = _quiet, down_after_run: bool | None = None) -> TrainResult:
        """Push the project, check the machine, write the run's config, start the payload under tmux."""
        project = self._project(project)
        loaded = self.settings(project_dir=project)
        s = loaded.settings
        entry = s.train.entry
        if not (project / entry).is_file():
            raise ProjectError(
                f"no entry point: {project / entry} does not exist",
                "Add train.py to the project, or set `[train] entry = \"your_script.py\"` in its gpuctl.toml.",
            )
        data = self._data_dir(data)
        record = self.resolve_cluster(cluster)
        inst, host = self._host(record)

        run_id = f"{_slug(project.name)}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        payload_dir = posixpath.join(host.root, "payload")
        paths = jobs.JobPaths(posixpath.join(host.root, "runs", run_id))
        sync, data_sync, code_dir, data_dir = self._push(host, project, data)
        host.push(PAYLOAD_DIR, payload_dir)
        report = None
        if record.provider != "local":  # this machine is what it is; a remote one is checked first
            report = preflight.preflight(host, payload_dir)
            progress(f"preflight on {host.label}: {preflight.summary(report)}")
            refusal = preflight.verdict(report, allow_cpu)
            if refusal:
                raise RemoteError(f"not starting on {host.label}: {refusal}",
                                  "Pass --allow-cpu to train on the CPU anyway, or set `remote.python` to the "
                                  "Python that has TensorFlow with GPU support.")
        run = RunRecord(
            run_id=run_id, cluster=record.name, project=str(project), entry=entry, args=tuple(args),
            state="starting", started_at=time.time(), usd_per_hour=inst.usd_per_hour, run_dir=paths.run_dir,
        )
        config = {
            "run_id": run_id,
            "entry": entry,
            "usd_per_hour": inst.usd_per_hour,
            "budget_usd": s.guards.budget_usd,
            "mixed_precision": s.train.mixed_precision,
            "memory_growth": s.train.memory_growth,
            "report_path": paths.epochs,
        }
        config_path = posixpath.join(paths.run_dir, "run.json")
        host.write_text(config_path, json.dumps(config, indent=2))
        self.ledger.put_run(run)
        python = (report or {}).get("executable") or host.python
        env = {"GPUCTL_RUN_ID": run_id, "GPUCTL_RUN_DIR": paths.run_dir, "GPUCTL_OUTPUT_DIR": paths.outputs}
        if data_dir:
            env["GPUCTL_DATA_DIR"] = data_dir
        try:
            jobs.start_job(host, run_id, code_dir, [python, posixpath.join(payload_dir, LAUNCHER), config_path, *args], env, paths)
        except BaseException:
            self.ledger.put_run(run.model_copy(update={"state": "failed", "ended_at": time.time()}))
            raise
        run = run.model_copy(update={"state": "running"})
        self.ledger.put_run(run)
        how = self._install_guard(loaded, record, down_after_run)
        progress(f"watchdog: {how}")
        self.ledger.event("train", f"started {entry} in {project}", cluster=record.name, run_id=run_id)
        return TrainResult(run=run, code_sync=sync, data_sync=data_sync, session=run_id, host=host.label)

    def _run_on_live_cluster(self, run_id: str | None) -> tuple[RunRecord, ClusterRecord]:
        run = self.find_run(run_id)
        cluster = self.ledger.live_cluster(run.cluster)
        if cluster is None:
            raise NotFoundError(f"run {run.run_id} was on cluster {run.cluster!r}, which is down",
                                f"Its log and reports are kept: gpuctl logs {run.run_id}; gpuctl cost {run.run_id}")
        return run, cluster

    def pull(self, run_id: str | None, dest: Path) -> PullResult:
        """Bring a run's outputs, reports and log back from its instance."""
        run, cluster = self._run_on_live_cluster(run_id)
        _, host = self._host(cluster)
        target = Path(dest) / run.run_id
        files = host.pull_tree(run.run_dir, target)
        return PullResult(run_id=run.run_id, dest=str(target), files=files)

    def exec(self, command: tuple[str, ...], cluster: str | None = None) -> list[ExecResult]:
        """Run a command on every host of the cluster, in parallel."""
        from concurrent.futures import ThreadPoolExecutor

        if not command:
            raise ConfigError("no command given", "Put the command after --, e.g. `gpuctl exec -- nvidia-smi`.")
        pairs = self._hosts(self.resolve_cluster(cluster))
        with ThreadPoolExecutor(max_workers=min(16, len(pairs))) as pool:
            results = list(pool.map(lambda p: p[1].run(list(command), check=False), pairs))
        return [ExecResult(host=h.label, returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)
                for (_, h), r in zip(pairs, results)]

    # --- guards ---------------------------------------------------------------------------------

    def _guard_config(self, loaded: LoadedSettings, cluster: ClusterRecord, inst: InstanceRecord, host: Host,
                      existing: dict[str, Any], down_after_run: bool | None = None) -> dict[str, Any]:
        """The watchdog's config from the settings; values the user never set keep what the host has
        (so a `guard set` survives the next `train`)."""
        g = loaded.settings.guards
        fresh: dict[str, tuple[str, Any]] = {  # config key -> (setting, value)
            "idle_s": ("guards.idle", g.seconds("idle")),
            "stall_s": ("guards.stall", g.seconds("stall")),
            "on_stall": ("guards.on_stall", g.on_stall),
            "grace_s": ("guards.grace", g.seconds("grace")),
            "check_interval_s": ("guards.check_interval", g.seconds("check_interval")),
            "gpu_idle_percent": ("guards.gpu_idle_percent", g.gpu_idle_percent),
            "budget_usd": ("guards.budget_usd", g.budget_usd),
            "down_after_run": ("guards.down_after_run", g.down_after_run),
            "on_fire": ("guards.on_fire", g.on_fire or ("poweroff" if cluster.provider == "aws" else "stop-jobs")),
            "poweroff_command": ("guards.poweroff_command", g.poweroff_command),
            "hard_cap_at": ("guards.max_hours",
                            inst.launched_at + g.max_hours * 3600 if cluster.provider == "aws" else None),
        }
        cfg = dict(existing)
        for key, (setting, value) in fresh.items():
            if key not in cfg or loaded.sources.get(setting, "default") != "default":
                cfg[key] = value
        if down_after_run is not None:
            cfg["down_after_run"] = down_after_run
        if cfg.get("down_after_run") and (down_after_run or not existing.get("down_after_run")):
            cfg["down_after_run_since"] = time.time()
        cfg.update(runs_dir=posixpath.join(host.root, "runs"), tmux_socket=host.tmux_socket,
                   usd_per_hour=inst.usd_per_hour, started_at=inst.launched_at, cluster=cluster.name)
        return cfg

    def _install_guard(self, loaded: LoadedSettings, cluster: ClusterRecord, down_after_run: bool | None = None) -> str:
        inst, host = self._host(cluster)
        payload_dir = posixpath.join(host.root, "payload")
        host.push(PAYLOAD_DIR, payload_dir)
        cfg = self._guard_config(loaded, cluster, inst, host, guard.read_config(host), down_after_run)
        return guard.install(host, cfg, host.python, payload_dir)

    def guard_show(self, cluster: str | None = None) -> GuardReport:
        record = self.resolve_cluster(cluster)
        _, host = self._host(record)
        return GuardReport(cluster=record.name, config=guard.read_config(host), state=guard.state(host))

    def guard_set(self, cluster: str | None = None) -> GuardReport:
        """Apply the guard flags to a live cluster. Everything is validated before the host is touched."""
        loaded = self.settings()  # raises ConfigError on a bad duration, budget or interval
        record = self.resolve_cluster(cluster)
        inst, host = self._host(record)
        existing = guard.read_config(host)
        if not existing:
            raise RemoteError(f"no watchdog on cluster {record.name!r} yet", "It is installed by `gpuctl train` "
                              "(and by `gpuctl up` on remote clusters).")
        cfg = self._guard_config(loaded, record, inst, host, existing)
        # Cross-check the merged values as the settings model would (e.g. idle vs check interval).
        interval = cfg["check_interval_s"]
        for name in ("idle_s", "stall_s"):
            if 0 < cfg[name] < interval:
                raise ConfigError(f"guards.{name[:-2]} ({cfg[name]:g}s) is shorter than the check interval "
                                  f"({interval:g}s) in force on {record.name}",
                                  "Raise it, or lower --check-interval in the same command.")
        if loaded.sources.get("guards.max_hours", "default") != "default" and record.provider == "aws":
            if not guard.set_hard_cap(host, loaded.settings.guards.max_hours):
                self.ledger.event("guard", "boot-time hard cap timer not found; the watchdog enforces max_hours",
                                  cluster=record.name)
        guard.write_config(host, cfg)
        self.ledger.event("guard", "set " + ", ".join(f"{k}={v}" for k, v in sorted(loaded.sources.items())
                                                    if k.startswith("guards.")), cluster=record.name)
        return GuardReport(cluster=record.name, config=cfg, state=guard.state(host))

    def guard_log(self, cluster: str | None = None) -> str:
        _, host = self._host(self.resolve_cluster(cluster))
        return guard.decisions(host)

    # --- interactive access ---------------------------------------------------------------------

    def shell_argv(self, cluster: str | None, command: list[str] | None) -> tuple[list[str], str | None]:
        """(argv, cwd) for a shell, or `command`, on the cluster's first host."""
        record = self.resolve_cluster(cluster)
        _, host = self._host(record)
        if record.provider == "local":
            return (command or [os.environ.get("SHELL", "/bin/sh")]), host.root
        remote = shlex.join(["cd", host.root]) + "; " + (shlex.join(command) if command else 'exec "$SHELL" -l')
        return host.ssh_argv("-t" if command is None else "-T", f"{host.ep.user}@{host.ep.host}", remote), None

    def attach_argv(self, run_id: str | None) -> tuple[list[str], str | None]:
        run, cluster = self._run_on_live_cluster(run_id)
        _, host = self._host(cluster)
        tmux = ["tmux", "-L", host.tmux_socket, "attach-session", "-t", f"={run.run_id}"]
        if cluster.provider == "local":
            return tmux, None
        return host.ssh_argv("-t", f"{host.ep.user}@{host.ep.host}", shlex.join(tmux)), None

    def ssh_config(self, install: bool = False) -> SshConfigResult:
        """Write $GPUCTL_HOME/ssh_config with a Host entry per live remote host; optionally Include it."""
        from gpuctl.remote.ssh import known_hosts_path

        lines = ["# Written by `gpuctl ssh-config`; rewritten each time. Do not edit.", ""]
        names = []
        for c in self.ledger.clusters(include_down=False):
            insts = [i for i in self.ledger.instances(c.name) if c.provider != "local" and i.public_ip]
            for n, inst in enumerate(insts):
                alias = c.name if n == 0 else f"{c.name}-{n}"
                names.append(alias)
                lines += [f"Host {alias}", f"    HostName {inst.public_ip}", f"    User {inst.ssh_user}",
                          f"    Port {inst.port or 22}",
                          f"    UserKnownHostsFile {known_hosts_path(self.home)}", "    StrictHostKeyChecking yes"]
                if inst.key_path:
                    lines += [f"    IdentityFile {inst.key_path}", "    IdentitiesOnly yes"]
                lines.append("")
        path = self.home / "ssh_config"
        path.write_text("\n".join(lines))
        included = None
        if install:
            user_cfg = Path(self.env.get("HOME", str(Path.home()))) / ".ssh" / "config"
            include = f"Include {path}"
            text = user_cfg.read_text() if user_cfg.exists() else ""
            if include not in text.splitlines():
                user_cfg.parent.mkdir(mode=0o700, exist_ok=True)
                # Include must come before any Host block to apply to every host.
                user_cfg.write_text(include + "\n" + text)
                os.chmod(user_cfg, 0o600)
            included = str(user_cfg)
        return SshConfigResult(path=str(path), hosts=tuple(names), included_from=included)

    def tensorboard(self, cluster: str | None, port: int) -> tuple[list[str] | None, str]:
        """Start TensorBoard over the runs on the instance (once); (forwarding argv or None, URL)."""
        record = self.resolve_cluster(cluster)
        _, host = self._host(record)
        remote_port = port if record.provider == "local" else 6006
        if not jobs.session_alive(host, "tensorboard"):
            probe = host.run([host.python, "-c", "import tensorboard"], check=False)
            if probe.returncode != 0:
                raise RemoteError(f"TensorBoard is not installed for {host.python} on {host.label}",
                                  f"Install it there: `{host.python} -m pip install tensorboard`.")
            paths = jobs.JobPaths(posixpath.join(host.root, "tensorboard"))
            cmd = [host.python, "-m", "tensorboard.main", "--logdir", posixpath.join(host.root, "runs"),
                   "--host", "127.0.0.1", "--port", str(remote_port)]
            jobs.start_job(host, "tensorboard", host.root, cmd, {}, paths)
        url = f"http://127.0.0.1:{port}/"
        if record.provider == "local":
            return None, url
        # Bound to 127.0.0.1 on the instance: reachable only through this SSH tunnel.
        return host.ssh_argv("-N", "-L", f"127.0.0.1:{port}:127.0.0.1:{remote_port}",
                             f"{host.ep.user}@{host.ep.host}"), url

    # --- runs: refresh, wait, logs --------------------------------------------------------------

    def find_run(self, run_id: str | None) -> RunRecord:
        if run_id:
            run = self.ledger.run(run_id)
            if run is None:
                raise NotFoundError(f"no run named {run_id!r}", "Run `gpuctl status` to list runs.")
            return run
        runs = self.ledger.runs()
        if not runs:
            raise NotFoundError("no run yet", "Start one with `gpuctl train PROJECT`.")
        return runs[-1]

    def _ingest_epochs(self, host: Host, run: RunRecord) -> list[EpochReport]:
        data = host.read_bytes(jobs.JobPaths(run.run_dir).epochs)
        known = {e.epoch for e in self.ledger.epochs(run.run_id)}
        fresh = []
        for line in (data or b"").decode("utf-8", "replace").splitlines():
            try:
                report = EpochReport.model_validate_json(line)
            except ValidationError:
                continue  # a line being written right now, or not ours
            if report.run_id == run.run_id and report.epoch not in known:
                fresh.append(report)
        self.ledger.put_epochs(fresh)
        return fresh

    def refresh_run(self, run: RunRecord) -> RunRecord:
        """Bring a live run's state and epochs from its instance into the ledger."""
        if run.state in FINAL_RUN_STATES:
            return run
        cluster = self.ledger.live_cluster(run.cluster)
        if cluster is None:
            updated = run.model_copy(update={"state": "lost", "ended_at": run.ended_at or time.time()})
            self.ledger.put_run(updated)
            return updated
        _, host = self._host(cluster)
        state, code = jobs.job_state(host, run.run_id, jobs.JobPaths(run.run_dir))
        epochs = self._ingest_epochs(host, run)
        update: dict[str, Any] = {}
        planned = next((e.epochs_planned for e in reversed(epochs) if e.epochs_planned), None)
        if planned and planned != run.epochs_planned:
            update["epochs_planned"] = planned
        if state == "failed" and code == 143:
            state = "stopped"  # SIGTERM: stopped by `down` or a guard, after its graceful exit
        if state != run.state:
            update["state"] = state
            update["exit_code"] = code
            if state in FINAL_RUN_STATES:
                update["ended_at"] = time.time()
        if update:
            run = run.model_copy(update=update)
            self.ledger.put_run(run)
            if "state" in update and state in FINAL_RUN_STATES:
                self.ledger.event("run-" + state, f"exit code {code}", cluster=run.cluster, run_id=run.run_id)
        return run

    def wait(self, run_id: str, poll_s: float = 1.0, timeout_s: float | None = None) -> RunRecord:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            run = self.refresh_run(self.find_run(run_id))
            if run.state in FINAL_RUN_STATES:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise RemoteError(f"run {run_id} still running after {timeout_s:.0f}s", f"Follow it: gpuctl logs -f {run_id}")
            time.sleep(poll_s)

    def _archived_log(self, run_id: str) -> Path:
        return self.home / "logs" / f"{run_id}.log"

    def _read_log(self, run: RunRecord, offset: int) -> bytes:
        cluster = self.ledger.live_cluster(run.cluster)
        if cluster is not None:
            _, host = self._host(cluster)
            data = host.read_bytes(jobs.JobPaths(run.run_dir).log, offset)
            if data is not None:
                return data
        try:
            with open(self._archived_log(run.run_id), "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except FileNotFoundError:
            return b""

    def logs(self, run_id: str | None = None, follow: bool = False, poll_s: float = 0.5) -> Iterator[str]:
        """The run's output; with follow, keeps yielding until the run has ended and all is read."""
        run = self.find_run(run_id)
        offset = 0
        while True:
            chunk = self._read_log(run, offset)
            offset += len(chunk)
            if chunk:
                yield chunk.decode("utf-8", "replace")
            if not follow:
                return
            if run.state in FINAL_RUN_STATES and not chunk:
                return
            if not chunk:
                time.sleep(poll_s)
            run = self.refresh_run(run)

    def log_tail(self, run: RunRecord, lines: int = 20) -> str:
        text = self._read_log(run, 0).decode("utf-8", "replace")
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

    # --- status and cost ------------------------------------------------------------------------

    def _refreshed_runs(self) -> list[RunRecord]:
        return [self.refresh_run(r) for r in self.ledger.runs()]

    def _cluster_cost(self, c: ClusterRecord, now: float) -> tuple[ClusterCost, int]:
        """Uptime and dollars: EC2's rules (per second, 60 s minimum, spot piecewise, EBS storage) for
        cloud instances; seconds x the set rate for local and ssh machines."""
        instances = self.ledger.instances(c.name)
        uptime = compute = storage = rate = savings = 0.0
        for inst in instances:
            end = inst.terminated_at or c.terminated_at or now
            seconds = max(0.0, end - inst.launched_at)
            uptime = max(uptime, seconds)
            rate += inst.usd_per_hour
            if c.provider == "aws":
                steps = list(inst.price_steps) or [(inst.launched_at, inst.usd_per_hour)]
                periods = [(a, b if b is not None else end) for a, b in inst.periods] or [(inst.launched_at, end)]
                usd = billing.compute_cost(periods, steps)
                compute += usd
                # The volume is billed while the instance is stopped too: storage covers the whole life.
                storage += billing.storage_cost(c.spec.disk_gb, inst.launched_at, end)
                if inst.market == "spot" and inst.on_demand_usd_per_hour:
                    billed = sum(billing.billed_seconds(a, b) for a, b in periods)
                    savings += billed * inst.on_demand_usd_per_hour / 3600.0 - usd
            else:
                compute += seconds * inst.usd_per_hour / 3600.0
        cost = ClusterCost(name=c.name, provider=c.provider, state=c.state, uptime_s=uptime, usd_per_hour=rate,
                           usd=compute + storage, compute_usd=compute, storage_usd=storage,
                           spot_savings_usd=savings if savings else None)
        return cost, len(instances)

    def _guard_status(self, cluster: ClusterRecord) -> dict[str, Any] | None:
        """What the watchdog last saw and when each guard fires; never fails `status`."""
        try:
            timeout = min(STATUS_CONNECT_TIMEOUT_S, self.settings().settings.remote.connect_timeout_s)
            _, host = self._hosts(cluster, connect_timeout_s=timeout)[0]
            st = guard.state(host)
        except GpuctlError as exc:
            return {"error": exc.message}
        return st or None

    def reconcile(self, cluster: ClusterRecord) -> ClusterRecord:
        """Bring a cloud cluster's instance states from the provider into the ledger; a cluster
        whose instances all ended (a guard's poweroff, a spot interruption) is closed at that time."""
        reconcile = getattr(self._provider(cluster.provider), "reconcile", None)
        instances = self.ledger.instances(cluster.name)
        if reconcile is None or not instances:
            return cluster
        fresh = reconcile(instances)
        for old, new in zip(instances, fresh):
            if new != old:
                self.ledger.put_instance(new)
            if new.state != old.state:
                self.ledger.event("instance-" + new.state, new.state_reason or "", cluster=cluster.name)
        ended = [i.terminated_at for i in fresh if i.state in ("terminated", "shutting-down")]
        if len(ended) == len(fresh):
            self.ledger.mark_cluster_down(cluster.name, max(t or time.time() for t in ended))
            return cluster.model_copy(update={"state": "down"})
        return cluster

    def status(self) -> StatusReport:
        now = time.time()
        clusters = []
        for c in self.ledger.clusters():
            if c.state == "up":
                self.reconcile(c)
        for c in self.ledger.clusters():
            cost, n = self._cluster_cost(c, now)
            reasons = {i.state_reason for i in self.ledger.instances(c.name) if i.state_reason} if n else set()
            clusters.append(ClusterStatus(**cost.model_dump(), is_default=c.is_default, instances=n,
                                          guard=self._guard_status(c) if c.state == "up" and n else None,
                                          note="; ".join(sorted(reasons)) or None))
        runs = []
        for r in self._refreshed_runs():
            epochs = self.ledger.epochs(r.run_id)
            elapsed = max(0.0, (r.ended_at or now) - r.started_at)
            runs.append(
                RunStatus(
                    run_id=r.run_id,
                    cluster=r.cluster,
                    state=r.state,
                    exit_code=r.exit_code,
                    epoch=epochs[-1].epoch if epochs else 0,
                    epochs_planned=r.epochs_planned,
                    metrics=epochs[-1].metrics if epochs else {},
                    elapsed_s=elapsed,
                    usd=elapsed * r.usd_per_hour / 3600.0,
                    log_tail=self.log_tail(r, 5) if r.state in ("failed", "lost") else None,
                )
            )
        return StatusReport(clusters=tuple(clusters), runs=tuple(runs))

    def _with_machine(self, rc: RunCost) -> RunCost:
        """Which machine a run's dollars bought: its cluster's instance type and market."""
        try:
            inst = self.ledger.instances(rc.cluster)[0]
        except (KeyError, IndexError):
            return rc
        return rc.model_copy(update={"instance_type": inst.instance_type or self._cluster_provider(rc.cluster),
                                     "market": inst.market})

    def _cluster_provider(self, name: str) -> str:
        return next((c.provider for c in reversed(self.ledger.clusters()) if c.name == name), "?")

    def compare(self, run_ids: tuple[str, ...]) -> CostReport:
        """Runs side by side; at least two."""
        if len(run_ids) < 2:
            raise ConfigError("--compare needs at least two runs", "Name two or more: gpuctl cost --compare RUN1 RUN2")
        return self.cost(run_ids)

    def cost(self, run_ids: tuple[str, ...] = ()) -> CostReport:
        """Every cluster's spend, and every run's (or only the named runs') epochs and projection."""
        for c in self.ledger.clusters(include_down=False):
            self.reconcile(c)
        runs = [self.refresh_run(self.find_run(r)) for r in run_ids] if run_ids else self._refreshed_runs()
        now = time.time()
        costs = tuple(self._with_machine(run_cost(r, self.ledger.epochs(r.run_id))) for r in runs)
        clusters = []
        for c in self.ledger.clusters():
            cost = self._cluster_cost(c, now)[0]
            in_epochs = sum(rc.spent_usd for rc in costs if rc.cluster == c.name) if not run_ids else None
            clusters.append(cost if in_epochs is None else
                            cost.model_copy(update={"idle_usd": max(0.0, cost.usd - in_epochs)}))
        return CostReport(clusters=tuple(clusters), runs=costs, total_usd=sum(c.usd for c in clusters))

    # --- down -----------------------------------------------------------------------------------

    def down(self, name: str | None = None, progress: Progress = _quiet) -> DownResult:
        """Stop every job of the cluster, keep its reports and logs, and release all it holds."""
        if name and self.ledger.live_cluster(name) is None:
            ended = [c for c in self.ledger.clusters() if c.name == name]
            if ended:
                # Closed already (e.g. its guard powered it off): still release what is left of it,
                # such as its security group and key pair.
                leftovers = self._release(ended[-1], progress)
                if not leftovers:
                    return DownResult(cluster=name, already_down=True)
                return DownResult(cluster=name, released=tuple(leftovers))
        cluster = self.resolve_cluster(name)
        stopped = self._stop_runs(cluster)
        resources = self._release(cluster, progress)
        self._close_in_ledger(cluster.name, f"released {len(resources)} resource(s)")
        return DownResult(
            cluster=cluster.name,
            stopped_runs=tuple(stopped),
            released_instances=tuple(r.id for r in resources if r.kind in ("instance", "workdir")),
            released=tuple(resources),
        )

    def _release(self, cluster: ClusterRecord, progress: Progress) -> list[Resource]:
        """Everything the provider still finds of the cluster, released; what was found."""
        provider = self._provider(cluster.provider)
        instances = self.ledger.instances(cluster.name)
        region = next((i.region for i in instances if i.region), None) or cluster.spec.region
        resources = provider.discover(cluster.name, region)
        provider.release(resources, progress)
        return resources

    def _close_in_ledger(self, cluster: str, message: str) -> None:
        """Mark the cluster's instances ended and the cluster down. An instance whose end is known
        already (from EC2, say) keeps that time: billing closes when it really ended."""
        now = time.time()
        instances = self.ledger.instances(cluster)
        for i in instances:
            if i.state != "terminated" or i.terminated_at is None:
                self.ledger.put_instance(i.model_copy(update={"state": "terminated",
                                                              "terminated_at": i.terminated_at or now}))
        self.ledger.mark_cluster_down(cluster, max([i.terminated_at or now for i in instances], default=now))
        self.ledger.event("down", message, cluster=cluster)

    def _stop_runs(self, cluster: ClusterRecord) -> list[str]:
        """Stop the cluster's live runs and keep their last epochs and logs in the ledger."""
        stopped = []
        for run in self.ledger.runs(cluster.name):
            run = self.refresh_run(run)
            if run.state in FINAL_RUN_STATES and self._archived_log(run.run_id).exists():
                continue
            _, host = self._host(cluster)
            paths = jobs.JobPaths(run.run_dir)
            if run.state not in FINAL_RUN_STATES:
                code = jobs.stop_job(host, run.run_id, paths)
                self._ingest_epochs(host, run)
                run = run.model_copy(update={"state": "stopped", "exit_code": code, "ended_at": time.time()})
                self.ledger.put_run(run)
                stopped.append(run.run_id)
            host.fetch(paths.log, self._archived_log(run.run_id))
        return stopped

    def inventory(self) -> Inventory:
        """`status --all`: every resource each provider finds by itself, ledger or not."""
        resources, notes = [], []
        live = [c.name for c in self.ledger.clusters(include_down=False)]
        for name in PROVIDERS:
            try:
                resources += self._provider(name).discover()
            except GpuctlError as exc:
                if any(c.provider == name for c in self.ledger.clusters(include_down=False)):
                    raise
                notes.append(f"{name}: not searched: {exc.message}")
        return Inventory(resources=tuple(resources), ledger_clusters=tuple(live), notes=tuple(notes))

    def down_all(self, progress: Progress = _quiet) -> DownResult:
        """Release everything every provider finds (tags, not memory), and close the ledger's clusters."""
        released: list[Resource] = []
        stopped: list[str] = []
        for name in PROVIDERS:
            clusters = [c for c in self.ledger.clusters(include_down=False) if c.provider == name]
            try:
                provider = self._provider(name)
                for c in clusters:
                    if self.ledger.instances(c.name):
                        try:
                            stopped += self._stop_runs(c)
                        except GpuctlError as exc:
                            progress(f"{c.name}: jobs not stopped ({exc.message}); releasing anyway")
                resources = provider.discover()
            except GpuctlError as exc:
                if clusters:
                    raise
                progress(f"{name}: not searched: {exc.message}")
                continue
            provider.release(resources, progress)
            released += resources
            for c in clusters:
                self._close_in_ledger(c.name, "released by down --all")
        return DownResult(
            cluster="*",
            already_down=not released,
            stopped_runs=tuple(stopped),
            released_instances=tuple(r.id for r in released if r.kind in ("instance", "workdir")),
            released=tuple(released),
        )


def cluster_spec(s: Settings) -> ClusterSpec:
    """What `up` asks the provider for, from the settings."""
    if s.provider == "local":
        return ClusterSpec(name=s.cluster, provider="local", usd_per_hour=s.local.usd_per_hour,
                           launch_token=secrets.token_hex(8))
    if s.provider == "ssh":
        if not s.ssh.hosts:
            raise ConfigError("the ssh provider needs at least one host",
                              "Pass --host user@host[:port] (repeat it for more), or set `[ssh] hosts`.")
        return ClusterSpec(name=s.cluster, provider="ssh", instance_type="ssh", usd_per_hour=s.ssh.usd_per_hour,
                           hosts=tuple(s.ssh.hosts), identity=s.ssh.identity or None, nodes=len(s.ssh.hosts),
                           launch_token=secrets.token_hex(8))
    a = s.aws
    return ClusterSpec(
        name=s.cluster,
        provider=s.provider,
        instance_type=a.instance_type,
        market=a.market,
        max_price=a.max_price or None,
        image=a.image or None,
        region=a.region or None,
        disk_gb=a.disk_gb,
        launch_token=secrets.token_hex(8),
    )


def run_cost(run: RunRecord, epochs: list[EpochReport]) -> RunCost:
    """Per-epoch rows plus the projection: mean epoch cost x planned epochs."""
    rows = tuple(
        EpochRow(
            epoch=e.epoch,
            seconds=e.seconds,
            examples=e.examples,
            examples_per_s=e.examples_per_s,
            epoch_cost_usd=e.epoch_cost_usd,
            cumulative_usd=e.cumulative_usd,
            metrics=e.metrics,
        )
        for e in epochs
    )
    done = len(rows)
    planned = run.epochs_planned or next((e.epochs_planned for e in reversed(epochs) if e.epochs_planned), None)
    spent = sum(r.epoch_cost_usd for r in rows)
    mean_usd = spent / done if done else None
    mean_s = sum(r.seconds for r in rows) / done if done else None
    total = remaining = finish = None
    if mean_usd is not None and planned:
        total = mean_usd * planned
        remaining = mean_usd * max(planned - done, 0)
        finish = epochs[-1].end + (mean_s or 0.0) * max(planned - done, 0)
    examples = sum(r.examples or 0 for r in rows)
    seconds = sum(r.seconds for r in rows)
    return RunCost(
        run_id=run.run_id,
        cluster=run.cluster,
        state=run.state,
        usd_per_hour=run.usd_per_hour,
        epochs_done=done,
        epochs_planned=planned,
        epochs=rows,
        mean_epoch_s=mean_s,
        mean_epoch_usd=mean_usd,
        spent_usd=spent,
        projected_remaining_usd=remaining,
        projected_total_usd=total,
        examples_per_s=examples / seconds if examples and seconds else None,
        usd_per_million_examples=spent / examples * 1e6 if examples else None,
        projected_finish_at=finish,
    )
