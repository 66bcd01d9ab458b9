"""The watchdog's decisions, as pure functions of what it saw. Stdlib only; Python 3.8+.

`decide(config, observation, now, memory)` is the whole judgement of one tick: it reads no clock,
no file and no process, so every edge (each limit's boundary, a clock that moved, a stale
heartbeat, a notice during a poweroff, a neighbour's job) is a test in milliseconds. The watchdog
(gpuctl_watchdog.py) observes, calls it, and does what it says. One small function per guard:

  budget    $/h x uptime reaches `budget_usd`
  run-done  `down_after_run`: a run ended (success or failure) after it was armed, `grace_s` ago
  hard-cap  `hard_cap_at` passed (the boot-time timer is the guard that needs no watchdog)
  stall     a started job, GPU idle, its log silent for `stall_s`: warn once (or fire); a node of
            several always fires (it waits for a peer that is gone: nobody's look stops it)
  idle      no job, GPU idle, no gpuctl command at work, no input on a counted login, no busy
            notebook kernel, for `idle_s`; with a notebook server open, a warning `idle_warn_s` before
  notice    a spot interruption notice came: a poweroff becomes stop-jobs (EC2 ends the instance
            itself, and bills none of a first hour then); so does a neighbour cluster at work
The first that fires, in that order, is the tick's reason.
"""

from collections import namedtuple
from typing import List

import gpuctl_logins  # beside this file on the instance
import gpuctl_protocol

# What one tick saw (gpuctl_watchdog.observe). runs: [Run]; gpu: the busiest GPU's % or None (no
# GPU); logins: (utmp path or None, counted, ignored) from gpuctl_logins; heartbeats: {name: mtime}
# of the busy/ files; fired: fired.json or None; notice: a spot notice is recorded; neighbours:
# {cluster: (jobs, at)} from the other clusters' state.json on this host.
# notebook: {"kernels", "busy"} of the cluster's notebook server (gpuctl_nbwatch.look), None: none answers.
Observation = namedtuple("Observation", "runs gpu logins heartbeats fired notice neighbours notebook",
                         defaults=(None,))
# One gpuctl run on this host: its pane lives (`running`), the instance's time its exit code was
# written (`ended_at`, else None), it waits in the cluster's queue (`queued`), its log's mtime (None: no log).
# `peers`: a job of several nodes (its node-started mark is there): stalled, it waits on a peer.
Run = namedtuple("Run", "name running ended_at queued log_mtime peers", defaults=(False,))
# What the watchdog carries from tick to tick: when the idle stretch began, whether idle fired in
# it (not again until something happens), the runs already warned of a stall, whether the notebook's
# users were warned of this idle stretch's end.
Memory = namedtuple("Memory", "idle_since idle_fired warned idle_warned", defaults=(False,))
FRESH = Memory(None, False, frozenset())
# reason/detail: what fires now (None: nothing); action: "poweroff" or "stop-jobs" if it fires;
# state: the picture for state.json (the observed parts are the watchdog's to add); notes: lines for
# decisions.log; forget: heartbeat files to remove (stale).
Decision = namedtuple("Decision", "reason detail action state memory notes forget")

NEIGHBOUR_FRESH_S = 180.0  # a neighbour's state this recent (either way on the clock) is alive


def number(data, key, default):
    """A number in fired.json or a login, the default when it is missing or not a finite number."""
    try:
        value = float(data.get(key, default))
    except (TypeError, ValueError):
        return float(default)
    return value if value == value and abs(value) != float("inf") else float(default)


def config(data):
    """The GuardConfig of a parsed config.json (or one already made)."""
    return data if isinstance(data, gpuctl_protocol.GuardConfig) else gpuctl_protocol.GuardConfig.from_dict(data)


def _started(cfg, now):
    return now if cfg.started_at is None else cfg.started_at


def spent_usd(cfg, now):
    """$/h x the time since the cluster started (none before it: a start ahead of this clock)."""
    return cfg.usd_per_hour * max(0.0, now - _started(cfg, now)) / 3600.0


def heartbeats(cfg, beats, now):
    """(fresh, stale) names of gpuctl commands' busy files: fresh while younger than
    `heartbeat_stale_s` by this host's clock. One from further ahead than that is stale too: the
    clock was set back after it was written, and a file that stays in the future would otherwise
    count as work (and keep the bill running) until the clock caught up."""
    stale_s = cfg.heartbeat_stale_s
    fresh: List[str] = []
    stale: List[str] = []
    for name, mtime in sorted(beats.items()):
        (fresh if -stale_s < now - mtime < stale_s else stale).append(name)
    return fresh, stale


def _beat_age(age):
    return "no heartbeat for %.0fs" % age if age >= 0 else "its heartbeat is %.0fs ahead of this clock" % -age


def budget(cfg, now):
    """(fires_at or None, detail if it fires now)."""
    limit, rate = cfg.budget_usd, cfg.usd_per_hour
    if limit <= 0:
        return None, None
    at = _started(cfg, now) + limit / rate * 3600.0 if rate > 0 else None
    spent = spent_usd(cfg, now)
    return at, ("$%.4f spent of a $%.4f budget" % (spent, limit) if spent >= limit else None)


def run_done(cfg, runs, fired, now):
    """(fires_at or None, detail if it fires now): a run that ended after `down_after_run_since`,
    `grace_s` ago, with no run going on, and not fired for already."""
    armed_at = cfg.down_after_run_since
    if not cfg.down_after_run or armed_at is None or any(r.running for r in runs):
        return None, None
    ended = [r.ended_at for r in runs if r.ended_at is not None and r.ended_at >= armed_at]
    if not ended:
        return None, None
    last = max(ended)
    if isinstance(fired, dict) and fired.get("reason") == "run-done" and number(fired, "at", 0) >= last:
        return None, None  # fired for this run already
    at = last + cfg.grace_s
    return at, ("the run ended %.0fs ago" % (now - last) if now >= at else None)


def hard_cap(cfg, now):
    """(fires_at or None, detail if it fires now)."""
    if not cfg.hard_cap_at:
        return None, None
    at = cfg.hard_cap_at
    return at, ("max_hours reached" if now >= at else None)


def stalls(cfg, runs, gpu_idle, now):
    """[(run name, seconds its log has been silent)] for started jobs that look hung."""
    limit = cfg.stall_s
    if limit <= 0 or not gpu_idle:
        return []
    out = []
    for run in runs:
        if run.running and not run.queued:  # a queued run has not started: not hung
            quiet = now - run.log_mtime if run.log_mtime is not None else 0.0
            if quiet >= limit:
                out.append((run.name, quiet))
    return out


def idle(cfg, working, gpu_idle, counted, now, memory):
    """(idle_since or None, fires_at or None, fires now, memory after this tick). The idle stretch
    starts at the first tick with no job, no GPU work and no gpuctl command, and never before the
    last input on a counted login (a keystroke ahead of this clock counts as now), so idle fires
    `idle_s` after the user's last keystroke. A counted login holds it off; once idle fired, it
    fires again only after something happened."""
    idle_fired = memory.idle_fired and not (working or counted or not gpu_idle)
    if working or not gpu_idle:
        return None, None, False, memory._replace(idle_since=None, idle_fired=idle_fired)
    since = memory.idle_since if memory.idle_since is not None else now
    for entry in counted:
        since = max(since, min(number(entry, "last_input", since), now))
    memory = memory._replace(idle_since=since, idle_fired=idle_fired)
    limit = cfg.idle_s
    if limit <= 0 or idle_fired:
        return since, None, False, memory
    return since, since + limit, not counted and now - since >= limit, memory


def idle_warning(cfg, notebook, idle_at, idle_now, now, memory):
    """(when idle fires, if a notebook server is open and that is within `idle_warn_s`, else None;
    memory). The window is at most half the idle limit, so a short limit still warns first."""
    if idle_at is None or idle_now or notebook is None:
        return None, memory._replace(idle_warned=False) if idle_at is None else memory
    window = min(cfg.idle_warn_s, cfg.idle_s / 2.0)
    return (idle_at if idle_at - now <= window else None), memory


def action(cfg, notice, neighbours, now):
    """(what firing does, why a poweroff was held back or None). A spot notice: EC2 ends the
    instance within two minutes and bills none of its first hour then, a poweroff of ours would
    be billed. Another cluster on this host at work (its watchdog saw a job lately): its work is
    not this cluster's to end."""
    act = cfg.on_fire
    if act != gpuctl_protocol.POWEROFF:
        return act, None
    if notice:
        return gpuctl_protocol.STOP_JOBS, "poweroff held back: a spot interruption notice came; EC2 ends the instance"
    busy = sorted(name for name, (jobs, at) in neighbours.items() if jobs and _recent(at, now))
    if busy:
        return gpuctl_protocol.STOP_JOBS, "poweroff held back: cluster(s) %s on this host run jobs" % ", ".join(busy)
    return act, None


def _recent(at, now):
    try:
        return abs(now - float(at)) < NEIGHBOUR_FRESH_S
    except (TypeError, ValueError):
        return False  # not a state this watchdog can read: it must not stop the firing


def decide(cfg, seen, now, memory=FRESH):
    """The tick's Decision from the config, what was seen (Observation), the time and the memory."""
    cfg = config(cfg)
    gpu_idle = seen.gpu is None or seen.gpu < cfg.gpu_idle_percent
    running = [r for r in seen.runs if r.running]
    fresh, stale = heartbeats(cfg, seen.heartbeats, now)
    _, counted, ignored = seen.logins
    notes = ["gpuctl command %s: %s, no longer counted" % (n, _beat_age(now - seen.heartbeats[n])) for n in stale]
    fires_at, found = {}, []
    for name, (at, detail) in (("budget", budget(cfg, now)), ("run-done", run_done(cfg, seen.runs, seen.fired, now)),
                               ("hard-cap", hard_cap(cfg, now))):
        if at is not None:
            fires_at[name] = at
        if detail:
            found.append((name, detail))
    stalled = stalls(cfg, seen.runs, gpu_idle, now)
    peers = {r.name for r in seen.runs if r.peers}
    for name, quiet in stalled:
        if name not in memory.warned:
            notes.append("WARN stall: %s: GPU idle and log silent for %.0fs" % (name, quiet))
        if cfg.on_stall == "fire" or name in peers:
            # A node of several, stalled, waits for a peer that is gone or hung (TensorFlow's collective
            # waits on): nobody's look ends it, so it fires whatever on_stall says.
            found.append(("stall", "%s hung: GPU idle, log silent %.0fs%s" % (
                name, quiet, " (a node of several: it waits for a peer)" if name in peers else "")))
    memory = memory._replace(warned=memory.warned | frozenset(n for n, _ in stalled))
    busy_kernels = bool(seen.notebook and seen.notebook.get("busy"))
    since, idle_at, idle_now, memory = idle(cfg, bool(running or fresh or busy_kernels), gpu_idle, counted, now, memory)
    if idle_at is not None:
        fires_at["idle"] = idle_at
    warning, memory = idle_warning(cfg, seen.notebook, idle_at, idle_now, now, memory)
    if warning is not None and not memory.idle_warned:
        notes.append("WARN idle: the notebook's kernels are idle; the idle guard fires in %.0fs" % (idle_at - now))
        memory = memory._replace(idle_warned=True)
    if idle_now:
        found.append(("idle", "idle for %.0fs (no job, GPU %s, no interactive login%s)" % (
            now - since, "absent" if seen.gpu is None else "%.0f%%" % seen.gpu,
            "; not counted: " + gpuctl_logins.summarize(ignored) if ignored else "")))
    reason, detail = found[0] if found else (None, None)
    act, held = action(cfg, seen.notice, seen.neighbours, now) if reason else (None, None)
    if held:
        notes.append(held)
    if reason == "idle":
        memory = memory._replace(idle_fired=True)  # one firing per idle stretch
    state = {"jobs": [r.name for r in running], "queued": [r.name for r in running if r.queued], "busy": fresh,
             "spent_usd": spent_usd(cfg, now), "budget_usd": cfg.budget_usd, "idle_since": since,
             "fires_at": fires_at, "stalled": [n for n, _ in stalled], "idle_warning": warning,
             "notebook": seen.notebook}
    return Decision(reason, detail, act, state, memory, notes, stale)


def inherited_idle_since(previous, cfg, boot):
    """The idle start an earlier watchdog recorded, if it may count: written in this boot, for this
    cluster, and never before this cluster started (a host used by an earlier cluster, or a state
    file from before a reboot, must not make a new cluster look idle for ages)."""
    cfg = config(cfg)
    since = previous.get("idle_since") if isinstance(previous, dict) else None
    if since is None or previous.get("boot_id") != boot or previous.get("cluster_key") != cfg.cluster_key:
        return None
    try:
        return max(float(since), cfg.started_at or 0.0)
    except (TypeError, ValueError):
        return None
