"""What a run is doing: its state and epochs brought from the instance into the ledger, its log
(live from the instance, archived once the cluster is gone), waiting for it, and stopping it."""

from __future__ import annotations

import codecs
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import ValidationError

from gpuctl.errors import GpuctlError, NotFoundError, RemoteError, UnreadableFile
from gpuctl.model import untrusted
from gpuctl.model.records import FINAL_RUN_STATES, ClusterRecord, EpochReport, RunRecord
from gpuctl.ops import nodes, queue, verdicts
from gpuctl.ops.log_filter import LineFilter
from gpuctl.ops.session import Session
from gpuctl.remote import jobs
from gpuctl.remote.host import Host, read_part
from gpuctl.retry import Backoff

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


def ingest_epochs(s: Session, node: nodes.Node, run: RunRecord) -> tuple[list[EpochReport], RunRecord]:
    """New epoch reports of the run, from the chief's epochs.jsonl into the ledger: only the bytes
    after those ingested before, a chunk at a time, at most MAX_SCAN bytes a look (more new at once:
    only its end, the rest skipped and named), each line bounded. A line that is not a
    believable report is skipped once and named (Session.note, and an event). The run, with how
    far its file was read, is recorded and returned."""
    path = jobs.JobPaths(run.run_dir).epochs
    source = f"{node.inst.id}:{run.run_dir}"
    offset = run.epochs_read if run.epochs_source == source else 0
    try:
        size = node.host.file_size(path) or 0
    except UnreadableFile as exc:  # a link loop the job made: nothing to ingest, and said
        s.note(f"run {run.run_id}'s reports not read: {exc.message}")
        return [], run
    # A file shorter than what was read of it was cut or replaced: read again from its start (the
    # epochs already known are not taken twice).
    if offset > size:
        offset = 0
    # More new at once than the reporter writes: only the end is read, whatever the file's size or
    # holes (a sparse GB cost every look 73 s), and what was skipped is named.
    skipped = max(0, size - offset - untrusted.MAX_SCAN)
    offset += skipped
    cut = skipped > 0 and node.host.read_bytes(path, offset - 1, 1) not in (b"\n", b"\0")
    known = {e.epoch for e in s.ledger.epochs(run.run_id)}
    lines = untrusted.Lines(untrusted.reads(node.host, path), offset, untrusted.MAX_LINE,
                            budget=untrusted.MAX_SCAN, cut=cut)
    fresh: dict[int, EpochReport] = {}
    bad: dict[str, int] = {}
    for line in lines:
        try:
            report = EpochReport.model_validate_json(line)
        except ValidationError as exc:
            why = _why(exc)
            bad[why] = bad.get(why, 0) + 1
            continue
        if report.run_id != run.run_id:
            bad["another run's id"] = bad.get("another run's id", 0) + 1
        elif report.epoch not in known:
            fresh[report.epoch] = report
            if len(fresh) >= 10_000:  # written in batches: memory stays flat on a huge file
                s.ledger.put_epochs(list(fresh.values()))
                known.update(fresh)
                fresh = {}
    if lines.too_long:
        bad[f"longer than {untrusted.MAX_LINE // 1024} KiB"] = lines.too_long
    s.ledger.put_epochs(list(fresh.values()))
    if skipped:
        text = (f"{skipped / (1 << 20):,.0f} MB of run {run.run_id}'s epochs.jsonl on {node.host.label} skipped: more than "
                f"{untrusted.MAX_SCAN >> 20} MB new at once is no report file, so only its last {untrusted.MAX_SCAN >> 20} MB "
                "were read")
        s.note(text)
        s.ledger.event("ignored", text, run_id=run.run_id)
    if bad:
        n = sum(bad.values())
        text = (f"{n} report line{'s' if n > 1 else ''} of run {run.run_id} from {node.host.label} ignored: "
                + "; ".join(f"{why} ({k})" if n > 1 else why for why, k in sorted(bad.items())[:3]))
        s.note(text)
        s.ledger.event("ignored", text, run_id=run.run_id)
    if (lines.offset, source) != (run.epochs_read, run.epochs_source):
        run = run.model_copy(update={"epochs_read": lines.offset, "epochs_source": source})
        s.ledger.put_run(run)
    return sorted(fresh.values(), key=lambda e: e.epoch), run


def _why(exc: ValidationError) -> str:
    """The first reason pydantic gives, in a few words: which field, what was wrong."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "line"
    return untrusted.one_line(f"{where}: {first.get('msg', 'invalid')}", 100)


def refresh(s: Session, run: RunRecord) -> RunRecord:
    """A look: the run's state and epochs from its instance into the ledger. It changes nothing
    anywhere but the ledger (`status`, `cost`, `logs`, a dashboard); `settle` is the one that acts."""
    return look(s, run)[0]


def settle(s: Session, run: RunRecord) -> RunRecord:
    """A look, then what it decided done: the nodes still running a run that ended elsewhere are
    stopped. Only commands that act call it (`train --wait`, `logs -f`, `watch`, `stop`, `down`,
    `train --resume`, `runs rm`, a plan's probe)."""
    run, decision, group = look(s, run)
    return apply(s, run, decision, group)


def pending(run: RunRecord) -> bool:
    """An ended run of several nodes with a node still seen running it (to stop, by settle or the
    node's guards)."""
    return run.state in FINAL_RUN_STATES and run.nodes > 1 and any(n in verdicts.RUNNING for n in run.node_states)


Looked = tuple[RunRecord, verdicts.Decision | None, list[nodes.Node]]


def look(s: Session, run: RunRecord) -> Looked:
    """Observe the run's nodes (read only), decide (verdicts.decide) and record the state in the
    ledger: (the run as recorded, the decision or None when nothing was asked, the nodes)."""
    if run.state in FINAL_RUN_STATES and not pending(run):
        return run, None, []
    cluster = s.live_cluster_of(run)
    if cluster is None:
        # Its machines ended (a guard's poweroff, an interruption) while nobody looked: the run
        # cost nothing after that, and nothing of it runs on.
        if run.state in FINAL_RUN_STATES:
            run = run.model_copy(update={"node_states": tuple("lost" if n in verdicts.RUNNING else n
                                                              for n in run.node_states)})
        else:
            ended = s.ledger.cluster(run.cluster_id).terminated_at or time.time()
            run = ending(run, "lost", run.ended_at or min(ended, time.time()), run.exit_code)
        s.ledger.put_run(run)
        return run, None, []
    if run.state == "starting" and time.time() - (run.resumed_at or run.started_at) < STARTING_S:
        # Its jobs are being started node after node: one not started yet is no lost node.
        return run, None, []
    group = nodes.of_run(s, cluster, run)
    # A node whose machine ended under the run is known by the ledger only (it cannot be asked).
    gone = nodes.gone(s, cluster, run)
    seen = verdicts.with_gone(nodes.states(group, run), gone)
    if verdicts.needs_notices(run, seen):
        # Before the run is called failed, or its nodes stopped: one whose machine heard a spot
        # notice is leaving anyway (and may be saving the checkpoint).
        seen = verdicts.with_notices(seen, nodes.notices(group))
    host, paths = group[0].host, jobs.JobPaths(run.run_dir)
    # The chief's reports are the run's (a worker's own, where the chief is gone, are not).
    chief_here = group[0].rank == 0
    place = None
    if run.gpus and chief_here and run.state not in FINAL_RUN_STATES:  # its job waits in the cluster's queue first
        place = queue.look(host, run.run_dir)
        placed = queue.follow(run, place, time.time())
        if placed != run:
            run = placed
            s.ledger.put_run(run)
    decision = verdicts.decide(run, seen, place, time.time(), chief=chief_here)
    epochs, run = ingest_epochs(s, group[0], run) if chief_here else ([], run)
    update: dict[str, Any] = {}
    planned = next((e.epochs_planned for e in reversed(epochs) if e.epochs_planned), None)
    if planned and planned != run.epochs_planned:
        update["epochs_planned"] = planned
    if decision.late and not run.not_started:
        update["not_started"] = decision.late
    if run.nodes > 1:
        if tuple(n.state for n in seen) != run.node_states:
            update["node_states"] = tuple(n.state for n in seen)
        if decision.failed_node is not None and decision.failed_node != run.failed_node:
            update["failed_node"] = decision.failed_node
    ends = decision.state != run.state
    if ends:
        update["state"] = decision.state
        update["exit_code"] = decision.exit_code
    if update:
        run = run.model_copy(update=update)
        if ends and decision.state in FINAL_RUN_STATES:
            gone_at = gone.terminated_at if gone is not None else None
            at = ended_at(host, paths, run) if chief_here else min(time.time(), gone_at or time.time())
            run = ending(run, decision.state, at, decision.exit_code)
        s.ledger.put_run(run)
        if ends and decision.state in FINAL_RUN_STATES:
            where = f" on node {run.failed_node}" if run.failed_node is not None else ""
            s.ledger.event("run-" + decision.state, f"exit code {decision.exit_code}{where}", cluster=cluster,
                           run_id=run.run_id)
            if decision.stop:
                s.ledger.event("run-waiting", _waiting(s, cluster, run, decision), cluster=cluster, run_id=run.run_id)
    return run, decision, group


def _waiting(s: Session, cluster: ClusterRecord, run: RunRecord, decision: verdicts.Decision) -> str:
    """What the look that found a run ended on one node says of the nodes still running it: they
    wait for it, billed, until a command that acts stops them or their own guard does."""
    waiting = ", ".join(str(r) for r in decision.stop if r not in decision.late)
    why = (f"node(s) {', '.join(map(str, decision.late))} did not start" if decision.late
           else f"node {run.failed_node} ended it")
    return (f"{why}; node(s) {waiting or '-'} still run it and wait, billed: their stall guard ends them (GPU idle "
            f"and log silent for guards.stall), a follower (`gpuctl logs -f`, `watch`) at once, or now: "
            f"`gpuctl stop {run.run_id}`")


def apply(s: Session, run: RunRecord, decision: verdicts.Decision | None, group: list[nodes.Node]) -> RunRecord:
    """Do what a look decided: stop the nodes still running a run that ended (they would wait for
    their peers, billed) and record them stopped (a node tmux did not confirm: said in an event)."""
    if decision is None or not decision.stop:
        return run
    unconfirmed = nodes.stop_rest(group, run, decision.stop)
    states = decision.after_stop(unconfirmed)
    if states != run.node_states:
        run = run.model_copy(update={"node_states": states})
        s.ledger.put_run(run)
    if unconfirmed:
        s.ledger.event("run-unconfirmed", f"node(s) {', '.join(map(str, sorted(unconfirmed)))} not confirmed stopped "
                       "(tmux does not answer there): `gpuctl down` ends what runs on", run_id=run.run_id,
                       cluster=s.ledger.cluster(run.cluster_id))
    return run


def ended_at(host: Host, paths: jobs.JobPaths, run: RunRecord) -> float:
    """When the run ended: its start plus how long it ran by the instance's clock (not when this
    client happened to look, and not skewed by the two clocks disagreeing); never after now, as
    this machine saw it (an `ended` far ahead is not believed)."""
    ran = jobs.duration(host, paths)  # of the job's last start: the resumed one, after train --resume
    now = time.time()
    return min((run.resumed_at or run.started_at) + ran, now) if ran is not None else now


def refresh_or_keep(s: Session, run: RunRecord) -> RunRecord:
    """refresh() (a look), or the ledger's view of the run when its host does not answer (status
    and cost must answer anyway; status says which host did not)."""
    return _or_keep(refresh, s, run)


def settle_or_keep(s: Session, run: RunRecord) -> RunRecord:
    """settle() (a look that acts), or the ledger's view of the run when its host does not answer."""
    return _or_keep(settle, s, run)


def _or_keep(step: Callable[[Session, RunRecord], RunRecord], s: Session, run: RunRecord) -> RunRecord:
    try:
        return step(s, run)
    except GpuctlError:
        return run


def wait(s: Session, run_id: str, poll_s: float = 1.0, timeout_s: float | None = None) -> RunRecord:
    """Block until the run has ended; the final record."""
    pauses = Backoff(poll_s, timeout_s=math.inf if timeout_s is None else timeout_s, clock=s.clock)
    while True:
        run = settle(s, s.find_run(run_id))
        if run.state in FINAL_RUN_STATES:
            return run
        if pauses.expired():
            raise RemoteError(f"run {run_id} still running after {timeout_s:.0f}s", f"Follow it: gpuctl logs -f {run_id}")
        pauses.pause()


FIRST_POLL_S = 0.1  # a followed log's first look after output
LOG_CHUNK = 1 << 20  # a log is read (and printed) this many bytes at a time: never whole


def _read_log(s: Session, run: RunRecord, offset: int, node: int = 0, limit: int = LOG_CHUNK) -> bytes:
    """At most `limit` bytes of the run's log from `offset` (negative: from its end), live from
    its host, else what was archived of it."""
    cluster = s.live_cluster_of(run)
    if cluster is not None:
        try:
            one = next((n for n in nodes.of(s, cluster) if n.rank == node), None)
            # A node whose machine ended has only what was archived of its log.
            data = one.host.read_bytes(one.paths(run).log, offset, limit) if one is not None else None
        except GpuctlError:
            if not archived_log(s, run.run_id, node).exists():
                raise
            data = None  # the host does not answer: what was archived of it
        if data is not None:
            return data
    try:
        with open(archived_log(s, run.run_id, node), "rb") as fh:
            return read_part(fh, offset, limit, os.fstat(fh.fileno()).st_size)
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
        s.connect_quickly()
    quiet = LineFilter(0 if raw else run.tf_log_level)
    offset = 0
    cluster = s.live_cluster_of(run) if follow else None
    decode = codecs.getincrementaldecoder("utf-8")("replace")  # a character may straddle two chunks
    # Right after output, the next look comes sooner (a job's last line is often just before its
    # end, which `train --wait` then reports within a tenth of a second); quiet, back to poll_s.
    pauses = Backoff(min(FIRST_POLL_S, poll_s), poll_s, clock=s.clock)
    with s.working(cluster, "logs") if cluster is not None else nullcontext():
        while True:
            chunk = _read_log(s, run, offset, node)
            offset += len(chunk)
            shown = quiet.feed(decode.decode(chunk)) if chunk else ""
            if shown:
                yield shown
            if len(chunk) == LOG_CHUNK:
                continue  # more is there already: read on, one chunk in memory at a time
            ended = run.state in FINAL_RUN_STATES and not chunk
            if not follow or ended:
                rest = quiet.flush()
                if rest:
                    yield rest
                return
            if chunk:
                pauses.reset()
            else:
                pauses.pause()
            run = settle(s, run)  # following acts: a node left waiting on its ended peers is stopped
            if check is not None:
                check(run)


def log_tail(s: Session, run: RunRecord, lines: int = 20) -> str:
    """The last lines of the run's output (of the node that ended a multi-node run), less
    TensorFlow's start-up chatter."""
    quiet = LineFilter(run.tf_log_level)
    # Only the log's end is read (a log may be gigabytes): its first line there may be cut.
    text = quiet.feed(_read_log(s, run, -TAIL_BYTES, run.failed_node or 0).decode("utf-8", "replace")) + quiet.flush()
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


TAIL_BYTES = 64 << 10  # of a log's end, for its last lines
