"""`gpuctl plan`'s probes: the project run for K epochs on one machine, and what that measured.

A probe of a type is an ordinary cluster (`plan-<id>-<type>`, launched through `clusters.up` as an
image bake's is): tagged, guarded (its hard cap at most one hour, and powered off a grace period
after its run ends even if gpuctl is gone), in the ledger and in `cost`, never the default
cluster, and released in a `finally` however the probe ends. A plan killed with SIGKILL leaves
it to `status --all` / `down --all`, as a killed `up` does. A probe of a cluster that was up
(`--cluster`) runs there as any run and leaves the cluster up.

Each probe runs in a thread of its own with a Session of its own (its own ledger connection) and
never raises for what a user can cause: a failed launch or run becomes its row's `problem`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from gpuctl.errors import GpuctlError
from gpuctl.model.requests import TrainRequest, UpRequest
from gpuctl.model.records import FINAL_RUN_STATES, EpochReport, InstanceRecord, RunRecord
from gpuctl.model.results import PlanRow, ProbeOutcome
from gpuctl.ops import clusters, costs, release, run_state, runs
from gpuctl.ops import stop as stop_ops
from gpuctl.ops.projection import Measured, bounded, one_line, project
from gpuctl.ops.session import Progress, Session
from gpuctl.remote import jobs
from gpuctl.retry import Backoff, EventClock

POLL_S = 1.0
FIRST_POLL_S = 0.1
UNANSWERED_S = 60.0  # a probe's host silent this long ends the probe


@dataclass(frozen=True)
class ProbeJob:
    """What every probe of one plan runs, and for how long at most."""

    project: Path
    args: tuple[str, ...]
    data: Optional[Path]
    allow_cpu: bool
    probe_epochs: int
    epochs: int  # what the projection is for
    timeout_s: float  # from the probe run's start; then it is stopped


@dataclass(frozen=True)
class Target:
    """One machine to probe, named and priced before anything starts."""

    source: Literal["type", "cluster"]  # "type": a probe cluster is launched; "cluster": one that is up
    label: str
    cluster: str  # the probe cluster's name, or the cluster that is up
    provider: str
    usd_per_hour: float  # the quote (type: the cheapest zone's spot price now) or the cluster's rate
    cap_hours: float  # how long it may bill at most: the hard cap (type) or --probe-timeout (cluster)
    instance_type: Optional[str] = None
    market: Optional[str] = None
    flags: dict[str, Any] = field(default_factory=dict)  # the probe cluster's session flags (type)
    worst_usd_per_hour: Optional[float] = None  # the most it may bill an hour (spot: its cap); None: usd_per_hour

    @property
    def worst_rate(self) -> float:
        return self.usd_per_hour if self.worst_usd_per_hour is None else self.worst_usd_per_hour


def probe(s: Session, job: ProbeJob, target: Target, progress: Progress, cancel: threading.Event) -> PlanRow:
    """Run one probe (in its own Session) and measure it; its row, failures included."""
    ps = Session(s.home, target.flags or s.flags, s.env)
    row = PlanRow(label=target.label, source=target.source, cluster=target.cluster, provider=target.provider,
                  instance_type=target.instance_type, market=target.market, usd_per_hour=target.usd_per_hour)
    started = time.time()
    try:
        if target.source == "type":
            return _on_new_cluster(ps, job, row, started, progress, cancel)
        return _measure(ps, job, row, started, target.cluster, progress, cancel, down_after_run=None)
    except GpuctlError as exc:
        return row.model_copy(update={"outcome": "failed", "problem": one_line(exc.message)})
    except Exception as exc:  # noqa: BLE001 - one probe's surprise must not lose the others' rows
        return row.model_copy(update={"outcome": "failed", "problem": one_line(f"{type(exc).__name__}: {exc}")})
    finally:
        ps.close()


def _on_new_cluster(ps: Session, job: ProbeJob, row: PlanRow, started: float, progress: Progress,
                    cancel: threading.Event) -> PlanRow:
    left = None
    try:
        # Nobody's default, and never the one a command that names no cluster picks (launched_for).
        up = clusters.up(ps, UpRequest(make_default=False, launched_for="plan"), progress)
        row = _as_launched(row, up.instances)
        if cancel.is_set():
            return row.model_copy(update={"outcome": "cancelled"})
        # Powered off a grace period after its run ends even if this gpuctl is killed meanwhile.
        row = _measure(ps, job, row, started, row.cluster, progress, cancel, down_after_run=True)
    except GpuctlError as exc:
        row = row.model_copy(update={"outcome": "failed", "problem": one_line(exc.message)})
    finally:
        left = release.release_own(ps, row.cluster, progress, f"releasing probe cluster {row.cluster}")
    if left is not None:  # still billing: the row says so, and the plan's exit code (cli/plan.py)
        row = row.model_copy(update={"released": False, "problem": one_line(left)})
    record = next((c for c in reversed(ps.ledger.clusters()) if c.name == row.cluster), None)
    if record is not None:
        row = row.model_copy(update={"probe_usd": costs.cluster_cost(ps, record, time.time())[0].usd})
    return row


def _as_launched(row: PlanRow, instances: tuple[InstanceRecord, ...] | list[InstanceRecord]) -> PlanRow:
    """The row's market as launched: a spot request that fell back to on-demand
    (aws.fallback_on_demand) is measured, priced and recommended as on-demand."""
    markets = {i.market for i in instances if i.market}
    if len(markets) != 1 or row.market is None or markets == {row.market}:
        return row
    (market,) = markets
    return row.model_copy(update={"market": market, "label": f"{row.instance_type} {market}"})


def _measure(ps: Session, job: ProbeJob, row: PlanRow, started: float, cluster: str, progress: Progress,
             cancel: threading.Event, down_after_run: bool | None) -> PlanRow:
    """Start the run, follow it to its end (or stop it), and read what it measured before its
    cluster goes."""
    result = runs.train(ps, TrainRequest(project=job.project, cluster=cluster, args=job.args, data=job.data,
                                         allow_cpu=job.allow_cpu, down_after_run=down_after_run,
                                         stop_after=job.probe_epochs), progress)
    run = result.run
    progress(f"run {run.run_id}: {job.probe_epochs} epoch(s) to measure")
    run, cut = _follow(ps, run, job.timeout_s, cancel)
    epochs = ps.ledger.epochs(run.run_id)
    row = row.model_copy(update={"run_id": run.run_id, "run_started_at": run.started_at,
                                 "usd_per_hour": run.usd_per_hour})
    outcome, problem = _outcome(ps, run, epochs, cut, job.probe_epochs)
    if outcome == "ok":
        # Launch, setup and push by this machine's clock; the script's start-up by the instance's.
        ready = (bounded(run.started_at - started) or 0.0) + _startup(ps, run, epochs)
        row = figures(row, Measured(epochs), ready, job.epochs)
    else:
        row = row.model_copy(update={"outcome": outcome, "problem": problem})
    if row.outcome == "ok":
        progress(f"measured: first epoch {row.first_epoch_s:.1f}s, steady {row.steady_epoch_s:.1f}s")
    else:
        progress(f"{row.outcome}: {row.problem}")
    if row.source == "cluster":
        row = row.model_copy(update={"probe_usd": costs.on_instance(ps, run, epochs, time.time())[1]})
    return row


def figures(row: PlanRow, m: Measured, ready_s: float, epochs: int) -> PlanRow:
    """The row with what was measured and what `epochs` epochs would take; unranked ("no reading")
    when the epochs' times cannot be believed: a machine must never look cheap for a 0 s epoch."""
    first = m.first_s
    steady = m.steady_s if m.steady_s is not None else first
    if not first or not steady:  # None (out of bounds) or 0 s
        return row.model_copy(update={
            "outcome": "no reading", "steady_epochs": m.steady_epochs,
            "problem": f"its {m.epochs} epoch report(s) gave no believable time (0 s, or over a week): "
                       "nothing to project"})
    seconds, usd = project(ready_s, first, steady, epochs, row.usd_per_hour)
    return row.model_copy(update={
        "ready_s": ready_s, "first_epoch_s": first, "steady_epoch_s": steady, "steady_epochs": m.steady_epochs,
        "examples_per_s": m.examples_per_s, "gpu_util_percent": m.gpu_util_percent,
        "gpu_memory_used_mib": m.gpu_memory_used_mib, "gpu_memory_total_mib": m.gpu_memory_total_mib,
        "projected_s": seconds, "projected_usd": usd})


def _follow(ps: Session, run: RunRecord, timeout_s: float, cancel: threading.Event) -> tuple[RunRecord, str | None]:
    """The run once it ended by itself, or stopped: (the run, None | "timed out" | "cancelled").
    A host that does not answer one look is asked again (a hiccup must not throw away a paid
    probe); one silent for UNANSWERED_S ends the probe, its run stopped where it can be."""
    # A probe may end in a second (a small script): looked at soon, then every POLL_S; a cancel ends a pause.
    pauses = Backoff(FIRST_POLL_S, POLL_S, timeout_s, EventClock(cancel))
    answered = pauses.elapsed()
    while True:
        try:
            run = run_state.settle(ps, ps.ledger.run(run.run_id) or run)
            answered = pauses.elapsed()
        except GpuctlError as exc:
            if pauses.elapsed() - answered > UNANSWERED_S:
                _stop_quietly(ps, run.run_id)
                raise GpuctlError(f"the probe's host did not answer for {UNANSWERED_S:g} s: {exc.message}") from None
        if run.state in FINAL_RUN_STATES:
            return run, None
        cut = "cancelled" if cancel.is_set() else "timed out" if pauses.expired() else None
        if cut:
            _stop_quietly(ps, run.run_id)
            return ps.ledger.run(run.run_id) or run, cut
        pauses.pause()


def _stop_quietly(ps: Session, run_id: str) -> None:
    """Stop the probe's run; a host that cannot be asked leaves it to its cluster's guards (a
    probe cluster is released next anyway)."""
    try:
        stop_ops.stop(ps, run_id)
    except GpuctlError:
        pass


def _outcome(ps: Session, run: RunRecord, epochs: list[EpochReport], cut: str | None,
             probe_epochs: int) -> tuple[ProbeOutcome, str | None]:
    if epochs and (len(epochs) >= probe_epochs or (cut is None and run.state == "succeeded")):
        return "ok", None  # measured (a script with fewer epochs than asked is measured on those)
    if cut == "timed out":
        return "timed out", (f"stopped after --probe-timeout with {len(epochs)} of {probe_epochs} epoch(s) "
                             "reported")
    if cut == "cancelled":
        return "cancelled", "stopped: the plan was interrupted"
    if run.state == "succeeded":
        return "no epochs", ("the script ended without reporting an epoch (a custom training loop reports "
                             "through gpuctl_report's `epoch`: docs/training.md)")
    try:
        tail = one_line(run_state.log_tail(ps, run, 5))
    except GpuctlError:
        tail = None
    return "failed", tail or f"the run {run.state} (exit code {run.exit_code})"


def _startup(ps: Session, run: RunRecord, epochs: list[EpochReport]) -> float:
    """From the job's start to its first epoch (imports, data, model), both by the instance's
    clock; 0 where it cannot be read or makes no sense (the instance's figures are untrusted)."""
    if not epochs:
        return 0.0
    try:
        cluster = ps.live_cluster_of(run)
        if cluster is None:
            return 0.0
        _, host = ps.host(cluster)
        began = jobs.started_at(host, jobs.JobPaths(run.run_dir))
    except GpuctlError:
        return 0.0
    if began is None:
        return 0.0
    return bounded(epochs[0].start - began) or 0.0
