"""`gpuctl stop [RUN]`: end runs and keep their cluster (and their checkpoints, for `train --resume`).

Each run is ended by run_state.stop_run, the same per-run stop `down` uses; this module only picks
the runs (one named, the cluster's latest live one, or all its live ones) under the cluster's lock,
so a `train` starting a job there finishes starting first.
"""

from __future__ import annotations

from gpuctl.errors import ConflictError, NotFoundError
from gpuctl.model.records import FINAL_RUN_STATES, ClusterRecord, RunRecord
from gpuctl.model.results import StopResult
from gpuctl.ops import run_state
from gpuctl.ops.session import BRAKE_LOCK_S, Progress, Session, quiet
from gpuctl.remote import jobs


def _released(run: RunRecord) -> NotFoundError:
    return NotFoundError(f"run {run.run_id} was on cluster {run.cluster!r}, which is released",
                         f"Nothing of it runs or bills any more; its log and reports stay: gpuctl logs {run.run_id}")


def stop(s: Session, run_id: str | None = None, cluster: str | None = None, every: bool = False,
         grace_s: float = jobs.STOP_GRACE_S, progress: Progress = quiet) -> StopResult:
    """Stop the run `run_id`, else the latest live run of `cluster` (default: the default
    cluster), else with `every` all its live runs. A named run that has ended is left as it is."""
    if run_id:
        return _stop_named(s, run_id, cluster, grace_s, progress)
    record = s.resolve_cluster(cluster)
    with s.cluster_lock(record, progress, wait_s=BRAKE_LOCK_S) as record:
        if record.state != "up":
            raise NotFoundError(f"cluster {record.name!r} was released while this command waited for it")
        live = [r for r in (run_state.settle(s, r) for r in s.ledger.runs(record.id)) if r.state not in FINAL_RUN_STATES]
        targets = live if every else live[-1:]
        stopped = tuple(run_state.stop_run(s, record, r, grace_s) for r in targets)
    return _result(s, record, targets, stopped, grace_s)


def _stop_named(s: Session, run_id: str, cluster: str | None, grace_s: float, progress: Progress) -> StopResult:
    run = s.find_run(run_id)
    if cluster and run.cluster != cluster:
        raise ConflictError(f"run {run.run_id} is on cluster {run.cluster!r}, not {cluster!r}",
                            f"Drop --cluster: gpuctl stop {run.run_id}")
    record = s.live_cluster_of(run)
    if record is None:
        raise _released(run)
    with s.cluster_lock(record, progress, wait_s=BRAKE_LOCK_S) as record:
        if record.state != "up":
            raise _released(run)
        run = run_state.settle(s, s.ledger.run(run.run_id) or run)
        if run.state in FINAL_RUN_STATES:
            return StopResult(cluster=record.name, grace_s=grace_s, already_ended=run)
        stopped = (run_state.stop_run(s, record, run, grace_s),)
    return _result(s, record, [run], stopped, grace_s)


def _result(s: Session, record: ClusterRecord, before: list[RunRecord], stopped: tuple[RunRecord, ...],
            grace_s: float) -> StopResult:
    """Logged, and which of the runs never started (taken out of the queue: no exit code; one that
    started meanwhile was stopped as any other)."""
    queued = {r.run_id for r in before if r.state == "queued"}
    dequeued = tuple(r.run_id for r in stopped if r.run_id in queued and r.exit_code is None)
    for run in stopped:
        how = "taken out of the queue" if run.run_id in dequeued else f"exit code {run.exit_code}"
        s.ledger.event("run-stopped", f"by gpuctl stop ({how})", cluster=record, run_id=run.run_id)
    return StopResult(cluster=record.name, grace_s=grace_s, stopped=stopped, dequeued=dequeued)
