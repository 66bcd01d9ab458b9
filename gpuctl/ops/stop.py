"""`gpuctl stop [RUN]`: end runs and keep their cluster (and their checkpoints, for `train --resume`).

Each run is ended by stop_run, the same per-run stop `down` uses (stop_runs); this module only picks
the runs (one named, the cluster's latest live one, or all its live ones) under the cluster's lock,
so a `train` starting a job there finishes starting first.
"""

from __future__ import annotations

import time

from gpuctl.errors import ConflictError, NotFoundError, RemoteTimeout, Unconfirmed
from gpuctl.model.records import FINAL_RUN_STATES, ClusterRecord, RunRecord
from gpuctl.model.results import StopResult
from gpuctl.ops import nodes, queue, run_state
from gpuctl.ops.session import BRAKE_LOCK_S, Progress, Session, each, quiet
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
        stopped = tuple(stop_run(s, record, r, grace_s) for r in targets)
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
        stopped = (stop_run(s, record, run, grace_s),)
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


def stop_runs(s: Session, cluster: ClusterRecord) -> tuple[list[str], list[str], str | None]:
    """Stop the cluster's live runs (on every node) and keep their last epochs in the ledger:
    (runs stopped, runs not confirmed stopped, why). A host whose command ran past its deadline
    (RemoteTimeout), or a job its tmux does not answer for (Unconfirmed), ends the stopping there:
    the runs still live then are named, so that `down` releases the cluster anyway; a host that
    does not answer at all raises. Their logs are ops/archive.py's."""
    stopped: list[str] = []
    try:
        if any(r.gpus and r.state not in FINAL_RUN_STATES for r in s.ledger.runs(cluster.id)):
            # Before any run is stopped: one stopped must not let a queued one start on a cluster going down.
            each(nodes.of(s, cluster), lambda n: queue.close(n.host))
        for run in s.ledger.runs(cluster.id):
            run = run_state.settle(s, run)
            if run.state not in FINAL_RUN_STATES:
                run = stop_run(s, cluster, run)
                stopped.append(run.run_id)
    except (RemoteTimeout, Unconfirmed) as exc:
        left = [r.run_id for r in s.ledger.runs(cluster.id) if r.state not in FINAL_RUN_STATES]
        return stopped, left, exc.message
    return stopped, [], None


def stop_run(s: Session, cluster: ClusterRecord, run: RunRecord, grace_s: float = jobs.STOP_GRACE_S) -> RunRecord:
    """Stop one live run on every node of it (SIGTERM, SIGKILL after `grace_s`): `stopped` in the
    ledger with its last epochs; its files and checkpoint stay for `train --resume`. The one
    per-run stop: `down` and `gpuctl stop` both end runs here."""
    group = nodes.of_run(s, cluster, run)
    host, paths = group[0].host, jobs.JobPaths(run.run_dir)
    # It was running when this machine looked a moment ago: it ran until now at least, whatever
    # its own `started` and `ended` files say (a job that wrote them would make itself free).
    ran_until = time.time() if run.state == "running" else 0.0
    # Out of the queue first, so it cannot start while it is stopped; one taken out never ran: no exit code.
    taken = run.state == "queued" and any(each(group, lambda n: queue.dequeue(n.host, run.run_id)))
    codes = nodes.stop(group, run, grace_s)
    _, run = run_state.ingest_epochs(s, group[0], run)
    run = run_state.ending(run, "stopped", max(run_state.ended_at(host, paths, run), ran_until), None if taken else codes[0])
    if run.nodes > 1:
        run = run.model_copy(update={"node_states": ("stopped",) * len(group)})
    s.ledger.put_run(run)
    return run
