"""The watchdog's files as the client believes them: guard/config.json, guard/state.json (with the
fired.json it embeds) and the answer of a dry look (`guard show --check`). They live on the
instance, so each field is bounded (model/untrusted.py) and read leniently: a field that fails is left
out and named, a file that is no JSON object reads as empty, and none of it is an internal error."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from gpuctl.model.untrusted import InstanceFile, Names, Percent, Pid, Seconds, Short, Stamp, Text, Usd


class GuardConfig(InstanceFile):
    """What `train` and `guard set` wrote (ops/guards.py `_config`); read back before a change."""

    idle_s: Optional[Seconds] = None
    idle_warn_s: Optional[Seconds] = None
    stall_s: Optional[Seconds] = None
    on_stall: Optional[Short] = None
    grace_s: Optional[Seconds] = None
    check_interval_s: Optional[Seconds] = None
    gpu_idle_percent: Optional[Percent] = None
    budget_usd: Optional[Usd] = None
    down_after_run: Optional[bool] = None
    down_after_run_since: Optional[Stamp] = None
    on_fire: Optional[Short] = None
    poweroff_command: Optional[Text] = None
    hard_cap_at: Optional[Stamp] = None
    runs_dir: Optional[Text] = None
    tmux_socket: Optional[Short] = None
    usd_per_hour: Optional[Usd] = None
    started_at: Optional[Stamp] = None
    cluster: Optional[Short] = None
    cluster_key: Optional[Short] = None
    heartbeat_stale_s: Optional[Seconds] = None
    notice: Optional[dict[Short, Any]] = Field(default=None, max_length=16)


class Fired(InstanceFile):
    """What the watchdog wrote when a guard fired: all four, or it is not believed."""

    reason: Short
    detail: Text
    at: Stamp
    action: Short


class Login(InstanceFile):
    user: Optional[Short] = None
    line: Optional[Short] = None
    host: Optional[Short] = None
    why: Optional[Short] = None
    quiet_s: Optional[Seconds] = None


class Logins(InstanceFile):
    utmp: Optional[Text] = None
    counted: list[Login] = Field(default=[], max_length=1000)
    ignored: list[Login] = Field(default=[], max_length=1000)


class NotebookSeen(InstanceFile):
    """The cluster's notebook server as the watchdog last asked it (payloads/gpuctl_nbwatch.py)."""

    kernels: int = Field(default=0, ge=0, le=100_000)
    busy: int = Field(default=0, ge=0, le=100_000)


class WatchdogState(InstanceFile):
    """state.json: the watchdog's latest look."""

    at: Optional[Stamp] = None
    jobs: Names = []
    queued: Names = []
    gpu_util: Optional[Percent] = None
    ssh_sessions: Optional[int] = Field(default=None, ge=0, le=100_000)
    logins: Optional[Logins] = None
    busy: Names = []
    spent_usd: Optional[Usd] = None
    budget_usd: Optional[Usd] = None
    idle_since: Optional[Stamp] = None
    fires_at: dict[Short, Optional[Stamp]] = Field(default={}, max_length=32)
    stalled: Names = []
    idle_warning: Optional[Stamp] = None  # a notebook server is open and idle fires then (soon)
    notebook: Optional[NotebookSeen] = None
    fired: Optional[Fired] = None
    pid: Optional[Pid] = None
    code: Optional[Short] = None
    boot_id: Optional[Short] = None
    cluster_key: Optional[Short] = None


class Watchdog(InstanceFile):
    pid: Optional[Pid] = None
    last_look: Optional[Stamp] = None
    alive: Optional[bool] = None


class Probes(InstanceFile):
    python: Optional[Short] = None
    utmp: Optional[Text] = None
    nvidia_smi: Optional[Text] = None
    systemd: Optional[bool] = None
    poweroff_command: Optional[Text] = None
    poweroff_found: Optional[bool] = None
    sudo_without_password: Optional[bool] = None


class DryLook(InstanceFile):
    """gpuctl_guard_check.py's answer: one look now by the watchdog's code."""

    now: Optional[Stamp] = None
    state: Optional[WatchdogState] = None
    would_fire: Optional[Short] = None
    detail: Optional[Text] = None
    watchdog: Optional[Watchdog] = None
    probes: Optional[Probes] = None
    error: Optional[Text] = None
