"""What a run is doing: its state and epochs brought from the instance into the ledger, its log
(live from the instance, archived once the cluster is gone), waiting for it, and stopping it."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import ValidationError

from gpuctl.errors import GpuctlError, NotFoundError, RemoteError
from gpuctl.ops import nodes
from gpuctl.ops.log_filter import LineFilter
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Session
from gpuctl.remote import jobs
from gpuctl.remote.host import Host
from gpuctl.types import FINAL_RUN_STATES, ClusterRecord, EpochReport, RunRecord



# How long a run may stay "starting" (its jobs being started, node after node) before a look at
# its nodes counts: a gpuctl killed while starting it leaves a run that is then found lost.
STARTING_S = 600.0


def ending(run: RunRecord, state: str, at: float, code: int | None = None) -> RunRecord:
    """The run in a final state at `at`, its current segment closed with that reason."""
    segments = run.segments
    if segments and segments[-1].ended_at is None:
        segments = segments[:-1] + (segments[-1].model_copy(update={"ended_at": at, "end": state}),)
    return run.model_copy(update={"state": state, "ended_at": at, "exit_code": code, "segments": segments})


def archived_log(s: Session, run_id: str, node: int = 0) -> Path:
    return s.home / "logs" / (f"{run_id}.log" if node == 0 else f"{run_id}.node-{node}.log")


def ingest_epochs(s: Session, host: Host, run: RunRecord) -> list[EpochReport]:
    """New epoch reports of the run, from the instance into the ledger."""
    data = host.read_bytes(jobs.JobPaths(run.run_dir).epochs)
    known = {e.epoch for e in s.ledger.epochs(run.run_id)}
    fresh = []
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        try:
            report = EpochReport.model_validate_json(line)
        except ValidationError:
            continue  # a line being written right now, or not ours
        if report.run_id == run.run_id and report.epoch not in known:
            fresh.append(report)
    s.ledger.put_epochs(fresh)
    return fresh


def refresh(s: Session, run: RunRecord) -> RunRecord:
    """Bring a live run's state and epochs from its instance into the ledger."""
    if run.state in FINAL_RUN_STATES:
        return run
    cluster = s.live_cluster_of(run)
    if cluster is None:
        # Its machines ended (a guard's poweroff, an interruption) while nobody looked: the run
        # cost nothing after that.
        ended = s.ledger.cluster(run.cluster_id).terminated_at or time.time()
        updated = ending(run, "lost", run.ended_at or min(ended, time.time()), run.exit_code)
        s.ledger.put_run(updated)
        return updated
    if run.state == "starting" and time.time() - (run.resumed_at or run.started_at) < STARTING_S:
        # Its jobs are being started node after node: one not started yet is no lost node.
        return run
    each = nodes.of_run(s, cluster, run)
    # A node whose machine ended under the run is known by the ledger only (it cannot be asked).
    gone = nodes.gone(s, cluster, run)
    seen = nodes.with_gone(nodes.states(each, run), gone)
    state, code, failed = nodes.verdict(seen)
    if state not in ("running", "succeeded") and run.nodes > 1:
        # Before the run is called failed, or its nodes stopped: one whose machine heard a spot
        # notice is leaving anyway (and may be saving the checkpoint).
        seen = nodes.with_notices(each, seen)
        state, code, failed = nodes.verdict(seen)
    if state != "running" and any(n.state == "running" for n in seen):
        # One node ended the run: the others would wait for it (billed) until TensorFlow gives up.
        nodes.stop_rest(each, run, seen)
        seen = [replace(n, state="stopped") if n.state == "running" else n for n in seen]
    host, paths = each[0].host, jobs.JobPaths(run.run_dir)
    # The chief's reports are the run's (a worker's own, where the chief is gone, are not).
    chief_here = each[0].rank == 0
    epochs = ingest_epochs(s, host, run) if chief_here else []
    update: dict[str, Any] = {}
    planned = next((e.epochs_planned for e in reversed(epochs) if e.epochs_planned), None)
    if planned and planned != run.epochs_planned:
        update["epochs_planned"] = planned
    if run.nodes > 1:
        if tuple(n.state for n in seen) != run.node_states:
            update["node_states"] = tuple(n.state for n in seen)
        if failed is not None and failed != run.failed_node:
            update["failed_node"] = failed
    if state != run.state:
        update["state"] = state
        update["exit_code"] = code
    if update:
        run = run.model_copy(update=update)
        if state in FINAL_RUN_STATES and "state" in update:
            gone_at = gone.terminated_at if gone is not None else None
            at = _ended_at(host, paths, run) if chief_here else min(time.time(), gone_at or time.time())
            run = ending(run, state, at, code)
        s.ledger.put_run(run)
        if "state" in update and state in FINAL_RUN_STATES:
            where = f" on node {run.failed_node}" if run.failed_node is not None else ""
            s.ledger.event("run-" + state, f"exit code {code}{where}", cluster=cluster, run_id=run.run_id)
    return run


def _ended_at(host: Host, paths: jobs.JobPaths, run: RunRecord) -> float:
    """When the run ended: its start plus how long it ran by the instance's clock (not when this
    client happened to look, and not skewed by the two clocks disagreeing)."""
    ran = jobs.duration(host, paths)  # of the job's last start: the resumed one, after train --resume
    return (run.resumed_at or run.started_at) + ran if ran is not None else time.time()


def refresh_or_keep(s: Session, run: RunRecord) -> RunRecord:
    """refresh(), or the ledger's view of the run when its host does not answer (status and cost
    must answer anyway; status says which host did not)."""
    try:
        return refresh(s, run)
    except GpuctlError:
        return run


def refreshed_runs(s: Session) -> list[RunRecord]:
    return [refresh_or_keep(s, r) for r in s.ledger.runs()]


def wait(s: Session, run_id: str, poll_s: float = 1.0, timeout_s: float | None = None) -> RunRecord:
    """Block until the run has ended; the final record."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        run = refresh(s, s.find_run(run_id))
        if run.state in FINAL_RUN_STATES:
            return run
        if deadline is not None and time.monotonic() > deadline:
            raise RemoteError(f"run {run_id} still running after {timeout_s:.0f}s", f"Follow it: gpuctl logs -f {run_id}")
        time.sleep(poll_s)


def _read_log(s: Session, run: RunRecord, offset: int, node: int = 0) -> bytes:
    cluster = s.live_cluster_of(run)
    if cluster is not None:
        try:
            one = next((n for n in nodes.of(s, cluster) if n.rank == node), None)
            # A node whose machine ended has only what was archived of its log.
            data = one.host.read_bytes(one.paths(run).log, offset) if one is not None else None
        except GpuctlError:
            if not archived_log(s, run.run_id, node).exists():
                raise
            data = None  # the host does not answer: what was archived of it
        if data is not None:
            return data
    try:
        with open(archived_log(s, run.run_id, node), "rb") as fh:
            fh.seek(offset)
            return fh.read()
    except FileNotFoundError:
        return b""


def check_node(run: RunRecord, node: int) -> None:
    """`--node N` names one of the run's nodes."""
    if not 0 <= node < max(run.nodes, 1):
        raise NotFoundError(f"run {run.run_id} has no node {node}: it ran on {max(run.nodes, 1)} node(s)",
                            f"Pass --node 0 to {max(run.nodes, 1) - 1}; node 0 is the chief.")


def logs(s: Session, run_id: str | None = None, follow: bool = False, poll_s: float = 0.5,
         raw: bool = False, check: Callable[[RunRecord], None] | None = None, node: int = 0) -> Iterator[str]:
    """The run's output (less TensorFlow's start-up chatter unless `raw`) on `node` (0: the
    chief); with follow, keeps yielding until the run has ended and all is read. `check` sees the
    run at every look (and may raise to end the following: recovery asks whether the instance
    still exists)."""
    run = s.find_run(run_id)
    check_node(run, node)
    if not follow:  # the archived log, or a clear error, rather than a long wait on a dead host
        s.connect_timeout_s = s.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S
    quiet = LineFilter(0 if raw else run.tf_log_level)
    offset = 0
    cluster = s.live_cluster_of(run) if follow else None
    with s.working(cluster, "logs") if cluster is not None else nullcontext():
        while True:
            chunk = _read_log(s, run, offset, node)
            offset += len(chunk)
            shown = quiet.feed(chunk.decode("utf-8", "replace")) if chunk else ""
            if shown:
                yield shown
            ended = run.state in FINAL_RUN_STATES and not chunk
            if not follow or ended:
                rest = quiet.flush()
                if rest:
                    yield rest
                return
            if not chunk:
                time.sleep(poll_s)
            run = refresh(s, run)
            if check is not None:
                check(run)


def log_tail(s: Session, run: RunRecord, lines: int = 20) -> str:
    """The last lines of the run's output (of the node that ended a multi-node run), less
    TensorFlow's start-up chatter."""
    quiet = LineFilter(run.tf_log_level)
    text = quiet.feed(_read_log(s, run, 0, run.failed_node or 0).decode("utf-8", "replace")) + quiet.flush()
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def stop_runs(s: Session, cluster: ClusterRecord) -> list[str]:
    """Stop the cluster's live runs (on every node) and keep their last epochs and logs in the ledger."""
    stopped = []
    for run in s.ledger.runs(cluster.id):
        run = refresh(s, run)
        if run.state in FINAL_RUN_STATES and archived_log(s, run.run_id).exists():
            continue
        each = nodes.of_run(s, cluster, run)
        host, paths = each[0].host, jobs.JobPaths(run.run_dir)
        if run.state not in FINAL_RUN_STATES:
            codes = nodes.stop(each, run)
            ingest_epochs(s, host, run)
            run = ending(run, "stopped", _ended_at(host, paths, run), codes[0])
            if run.nodes > 1:
                run = run.model_copy(update={"node_states": ("stopped",) * len(each)})
            s.ledger.put_run(run)
            stopped.append(run.run_id)
        for n in each:
            if n.host.fetch(n.paths(run).log, archived_log(s, run.run_id, n.rank)):
                os.chmod(archived_log(s, run.run_id, n.rank), 0o600)
    return stopped
