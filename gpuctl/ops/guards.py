"""The spend guards on the instance: arming the watchdog, `guard show`, `guard set`, `logs --guard`,
and what `status` shows of them."""

from __future__ import annotations

import functools
import hashlib
import posixpath
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuctl.errors import ConfigError, GpuctlError, RemoteError
from gpuctl.model import untrusted
from gpuctl.model.records import FINAL_RUN_STATES, ClusterRecord, InstanceRecord
from gpuctl.model.results import GuardCheck, GuardReport
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Session
from gpuctl.payloads.gpuctl_protocol import WATCHDOG_FILES, GuardConfig
from gpuctl.provision import Provider
from gpuctl.remote import guard, heartbeat, sync
from gpuctl.remote.guard_files import DryLook
from gpuctl.remote.host import Host, NodeFacts, output_tail
from gpuctl.remote.sync.ignore import IgnoreRules
from gpuctl.retry import TimedOut, poll

if TYPE_CHECKING:  # the settings' models are imported where settings are read: a report reads none
    from gpuctl.config.load import LoadedSettings

PAYLOAD_DIR = Path(__file__).resolve().parent.parent / "payloads"


def payload_dir(host: Host) -> str:
    return posixpath.join(host.root, "payload")


def push_payload(host: Host, facts: NodeFacts) -> str:
    """The payload files on the host, pushed once per command (`facts`: what the host answered in
    it; the files do not change while a command runs, and each push over SSH is an rsync
    connection), and not at all where the host has these very files already; their directory there."""
    with facts.lock:
        if facts.payload_dir is None:
            _push_payload(host)
            facts.payload_dir = payload_dir(host)
        return facts.payload_dir


def _push_payload(host: Host) -> None:
    # One hash of the files there instead of rsync's own connection (~0.3 s of every train over
    # SSH). Their content, not a stamp: a file changed or gone there (an older gpuctl's, a
    # half-done push) is pushed again. A host that lies about it could as well change them after.
    names, digest = _payload_files()
    where = payload_dir(host)
    check = ["sh", "-c", 'cd "$1" && shift && cat -- "$@" | sha1sum', "sh", where, *names]
    res = host.run(output_tail(check, 4096, 4096), check=False)
    if (res.stdout or "").split()[:1] != [digest]:
        # Without the last push's manifest every file goes: the tar stream (a host without rsync)
        # and the local copy trust it and would not send a file edited there at the same size.
        host.run(["rm", "-f", "--", sync.manifest_path(where)], check=False)
        host.push(PAYLOAD_DIR, where)


@functools.cache
def _payload_files() -> tuple[tuple[str, ...], str]:
    """What a push of the payload sends (its file names, sorted) and the sha1 of their contents in
    that order, as `cat names | sha1sum` gives it."""
    names = tuple(sorted(sync.scan(PAYLOAD_DIR, IgnoreRules.for_project(PAYLOAD_DIR))))
    return names, _sha1_of(names)


def _sha1_of(names: tuple[str, ...]) -> str:
    """sha1 of these payload files' contents, one after the other in this order."""
    digest = hashlib.sha1()
    for name in names:
        digest.update((PAYLOAD_DIR / name).read_bytes())
    return digest.hexdigest()


def _config(loaded: LoadedSettings, provider: Provider, cluster: ClusterRecord, inst: InstanceRecord, host: Host,
            existing: dict[str, Any], down_after_run: bool | None = None, armed_at: float | None = None,
            cluster_rate: float | None = None) -> GuardConfig:
    """The watchdog's config from the settings; values the user never set keep what the host has
    (`existing`, as guard.read_config reads it: so a `guard set` survives the next `train`)."""
    from gpuctl.config import project

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
        "on_fire": ("guards.on_fire", g.on_fire or provider.capabilities.default_on_fire),
        "poweroff_command": ("guards.poweroff_command", g.poweroff_command),
        "hard_cap_at": ("guards.max_hours", inst.launched_at + _cap_hours(loaded, cluster) * 3600
                        if provider.capabilities.boot_hard_cap else None),
    }
    # What the host has counts only if this very cluster wrote it: a host used before by another
    # cluster must not lend it its limits (a 10 s idle guard carried over would fire at once).
    ours = dict(existing) if existing.get("cluster_key") == cluster_key(cluster) else {}
    cfg = dict(ours)
    for key, (setting, value) in fresh.items():
        if key in cfg and loaded.from_project(setting):
            # A project's file may tighten a guard, never loosen it: nor the one in force here
            # (a `guard set`, an `up --max-hours`), which may be stricter than the user's settings.
            if project.at_least_as_strict(setting, value, cfg[key]):
                cfg[key] = value
        elif key not in cfg or loaded.sources.get(setting, "default") != "default":
            cfg[key] = value
    if down_after_run is not None:
        cfg["down_after_run"] = down_after_run
    if cfg.get("down_after_run") and (down_after_run or not ours.get("down_after_run")):
        # The watchdog compares this with file times on the instance: the instance's clock, not ours.
        cfg["down_after_run_since"] = armed_at if armed_at is not None else instance_now(host)
    cfg.update(runs_dir=posixpath.join(host.root, "runs"), tmux_socket=host.tmux_socket,
               # The budget is the cluster's: each node counts the spend of all (they start together),
               # so a 4-node cluster stops at its budget, not at four times it.
               usd_per_hour=inst.usd_per_hour if cluster_rate is None else cluster_rate,
               started_at=inst.launched_at, cluster=cluster.name,
               cluster_key=cluster_key(cluster), heartbeat_stale_s=heartbeat.STALE_S,
               notice=provider.interruption_notice())
    # What the host had passed its own bounds (guard_files.py); the protocol's drops what it does not know.
    return GuardConfig.from_dict(cfg)


def check_limits(cfg: GuardConfig, where: str = "") -> None:
    """Idle and stall limits the watchdog can notice: none shorter than its check interval. Checked
    on the values that will be in force (the host's merged with this command's), before anything
    is written."""
    interval = cfg.check_interval_s
    for key in ("idle_s", "stall_s"):
        limit = getattr(cfg, key)
        if 0 < limit < interval:
            raise ConfigError(f"guards.{key[:-2]} ({limit:g}s) is shorter than check_interval ({interval:g}s){where}; "
                              "the watchdog could not notice it in time",
                              "Raise it, or lower the interval in the same command (--check-interval, "
                              "`guards.check_interval`).")


def check_settings(loaded: LoadedSettings) -> None:
    """The limits a new cluster's watchdog would get (`up`: every value comes from the settings)."""
    g = loaded.settings.guards
    check_limits(GuardConfig(check_interval_s=g.seconds("check_interval"), idle_s=g.seconds("idle"),
                             stall_s=g.seconds("stall")))


def check_for(s: Session, loaded: LoadedSettings, cluster: ClusterRecord) -> None:
    """The limits `train` would put in force on the cluster's first host, checked before it pushes."""
    inst, host = s.host(cluster)
    cfg = _config(loaded, s.provider(cluster.spec), cluster, inst, host, _existing(host, s.facts(host)), armed_at=0.0)
    check_limits(cfg, f" in force on {cluster.name}")


def _existing(host: Host, facts: NodeFacts) -> dict[str, Any]:
    """The watchdog's config as the host has it, read once per command until this command writes it."""
    if facts.guard_config is None:
        facts.guard_config = guard.read_config(host)
    return facts.guard_config


def cluster_key(cluster: ClusterRecord) -> str:
    """Names this `up` on the instance: the ledger's id alone is not enough (every gpuctl home
    numbers its clusters from 1), the launch token is random per `up`."""
    return f"{cluster.id}-{cluster.spec.launch_token}"


def instance_now(host: Host) -> float:
    """The instance's clock (a laptop's may be minutes off it)."""
    res = host.run(["date", "+%s"], check=False)
    try:
        return float(res.stdout.strip())
    except ValueError:
        return time.time()


def _cap_hours(loaded: LoadedSettings, cluster: ClusterRecord) -> float:
    """The hard cap armed at boot (the spec's) unless this command sets another."""
    if loaded.from_project("guards.max_hours"):  # a project's tightens it only
        return min(loaded.settings.guards.max_hours, cluster.spec.max_hours)
    if loaded.sources.get("guards.max_hours", "default") != "default":
        return loaded.settings.guards.max_hours
    return cluster.spec.max_hours


# The watchdog looks once as soon as it starts; that look may wait up to 30 s for nvidia-smi on a
# freshly booted instance with several GPUs.
FIRST_TICK_WAIT_S = 45.0


def install(s: Session, loaded: LoadedSettings, cluster: ClusterRecord, down_after_run: bool | None = None,
            armed_at: float | None = None) -> str:
    """Push the watchdog to every instance of the cluster and (re)start it with the settings'
    limits; a watchdog that was not running must show its first look, or this fails loudly."""
    provider = s.provider(cluster.spec)
    how = []
    pairs = s.hosts(cluster)
    rate = sum(inst.usd_per_hour for inst, _ in pairs)
    for inst, host in pairs:
        facts = s.facts(host)
        push_payload(host, facts)
        before = guard.state(host)
        cfg = _config(loaded, provider, cluster, inst, host, _existing(host, facts), down_after_run, armed_at, rate)
        facts.guard_config = None  # written below: a later look reads it afresh
        pid = before.get("pid")
        alive = _alive(host, pid)
        if alive and before.get("code") == code_version():
            # It runs this very code and rereads its config every second: the new limits are all
            # it needs (a service, loop and cron entry were set up by the install that started it).
            guard.write_config(host, cfg)
            how.append(f"running (pid {pid}), limits updated")
            continue
        how.append(guard.install(host, cfg, facts.python_of(host), payload_dir(host)))
        if alive:
            # Older code (gpuctl was upgraded): it would read the new config but not act on it (a
            # watchdog from before heartbeats takes a push for idleness). Its restart loop or
            # systemd brings the new code up within 2 s.
            host.run(["kill", str(pid)], check=False)
        _first_tick(host, before.get("at"))
    return how[0] + (f" (on each of {len(how)} instances)" if len(how) > 1 else "")


# The process is there and its command line names this cluster's config: after a reboot the
# pid in an old state.json may be anyone's (and `install` kills a watchdog running older code).
_IS_WATCHDOG = r'''[ -r "/proc/$1/cmdline" ] || exec kill -0 "$1"; tr '\0' ' ' < "/proc/$1/cmdline" | grep -qF -- "$2"'''


def _alive(host: Host, pid: Any) -> bool:
    return isinstance(pid, int) and host.run(["sh", "-c", _IS_WATCHDOG, "sh", str(pid), guard.config_path(host)],
                                             check=False).returncode == 0


@functools.cache  # asked on every look while a watchdog starts; its files do not change under gpuctl
def code_version() -> str:
    """What the watchdog reports as its code (`code` in state.json): the hash of its files."""
    return _sha1_of(WATCHDOG_FILES)[:12]


def _first_tick(host: Host, previous_at: Any) -> None:
    def looked() -> bool | None:
        st = guard.state(host)
        return True if st.get("at") and st.get("at") != previous_at and st.get("code") == code_version() else None

    try:
        # A watchdog's first look comes ~0.1 s after its start here, later on a slow instance: asked
        # soon and then less often (0.25 s first made every first `train` of a cluster wait that).
        poll(looked, FIRST_TICK_WAIT_S, first_delay_s=0.03, max_delay_s=2.0)
    except TimedOut:
        out = guard.output_tail(host)
        raise RemoteError(f"the watchdog on {host.label} did not start: no first look within {FIRST_TICK_WAIT_S:.0f}s"
                          + (f" ({out})" if out else ""),
                          "Nothing guards this instance's spend yet (the boot-time hard cap still does on aws). "
                          "Check `remote.python` and `gpuctl logs --guard`; `gpuctl down -y` releases it.") from None


def show(s: Session, cluster: str | None = None, check: bool = False) -> GuardReport:
    """Each guard's limit and what the watchdog last saw; with `check`, also one dry look on every
    instance, taken now by the watchdog's own code (nothing written, nothing fired)."""
    record = s.resolve_cluster(cluster)
    s.connect_quickly()  # a host that does not answer: said at once
    _, host = s.host(record)
    checks = tuple(GuardCheck(host=h.label, result=_dry_look(h, s.notes)) for _, h in s.hosts(record)) if check else ()
    return GuardReport(cluster=record.name, config=guard.read_config(host, s.notes), state=guard.state(host, s.notes),
                       run_budgets=_run_budgets(s, record), checks=checks, notes=tuple(s.notes))


def _dry_look(host: Host, notes: list[str]) -> dict[str, Any]:
    script = posixpath.join(payload_dir(host), guard.CHECK)
    res = host.run(output_tail([host.python, script, guard.config_path(host)]), check=False)
    lines = res.stdout.strip().splitlines()
    found = untrusted.read(DryLook, lines[-1].encode() if lines else None, f"the guard check on {host.label}", notes)
    if found:
        return found
    why = (res.stderr or res.stdout).strip().splitlines()
    return {"error": untrusted.one_line(why[-1], 300) if why else f"exit {res.returncode}"}


def _run_budgets(s: Session, cluster: ClusterRecord) -> dict[str, float]:
    return {r.run_id: r.budget_usd for r in s.ledger.runs(cluster.id)
            if r.budget_usd and r.state not in FINAL_RUN_STATES}


def apply(s: Session, cluster: str | None = None) -> GuardReport:
    """`guard set`: apply the guard flags to every instance of a live cluster, and re-arm a
    watchdog that no longer runs. Everything is validated before a host is touched."""
    loaded = s.settings()  # raises ConfigError on a bad duration or budget
    record = s.resolve_cluster(cluster)
    inst, host = s.host(record)
    notes: list[str] = []
    existing = guard.read_config(host, notes)
    if not existing and not notes:  # a config that is there but not believed is replaced below
        raise RemoteError(f"no watchdog on cluster {record.name!r} yet",
                          "It is installed by `gpuctl train` (and by `gpuctl up` on remote clusters).")
    provider = s.provider(record.spec)
    check_limits(_config(loaded, provider, record, inst, host, existing), f" in force on {record.name}")
    # The boot-time timer moves for the user's own value; a project's stricter one the watchdog
    # enforces (it may not push the timer out past a cap the user lowered since).
    if (loaded.sources.get("guards.max_hours", "default") != "default" and not loaded.from_project("guards.max_hours")
            and provider.capabilities.boot_hard_cap):
        for _, each in s.hosts(record):
            if not provider.set_hard_cap(each, loaded.settings.guards.max_hours):
                s.ledger.event("guard", f"{each.label}: boot-time hard cap timer not found; the watchdog enforces "
                                        "max_hours", cluster=record)
    install(s, loaded, record)
    s.ledger.event("guard", "set " + ", ".join(f"{k}={v}" for k, v in sorted(loaded.sources.items())
                                              if k.startswith("guards.")), cluster=record)
    return GuardReport(cluster=record.name, config=guard.read_config(host, notes), state=guard.state(host, notes),
                       run_budgets=_run_budgets(s, record), notes=tuple(notes))


def decisions(s: Session, cluster: str | None = None) -> str:
    """The watchdog's decision log (`logs --guard`)."""
    _, host = s.host(s.resolve_cluster(cluster))
    return guard.decisions(host)


def status_of(s: Session, cluster: ClusterRecord) -> dict[str, Any] | None:
    """What the watchdog last saw and when each guard fires; never fails `status`."""
    try:
        _, host = s.hosts(cluster, connect_timeout_s=REPORT_CONNECT_TIMEOUT_S)[0]
        st = guard.state(host, s.notes)
        if st:
            # Is anything still guarding? Its pid, and the age of its last look by the instance's clock.
            st["watchdog_alive"] = _alive(host, st.get("pid"))
            st["seen_s"] = max(0.0, instance_now(host) - float(st.get("at") or 0))
    except GpuctlError as exc:
        return {"error": exc.message}
    return st or None
