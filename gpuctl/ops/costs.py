"""Spend: `status` (what runs, what it has cost so far) and `cost` (per cluster, per run, per epoch,
with projections, the baked images' snapshot storage and the checkpoints' S3 storage). Every cluster `up` ever made is reported
with its own dollars, also after its name was used again."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from gpuctl.errors import ConfigError, GpuctlError, NotFoundError
from gpuctl.model import billing
from gpuctl.model.records import ENDED_STATES, RESUMABLE, ClusterRecord, EpochReport, InstanceRecord, Resource, RunRecord
from gpuctl.model.results import (
    ClusterCost,
    ClusterStatus,
    EpochRow,
    RunCost,
    RunStatus,
    SegmentCost,
    StatusReport,
)
from gpuctl.ops import clusters, guards, notebook_state, run_state, setup
from gpuctl.ops.segments import segment_costs
from gpuctl.ops.session import Session
from gpuctl.provision import PROVIDERS

if TYPE_CHECKING:  # `cost` and `status --all` import them: `status` builds none of the storage models
    from gpuctl.ops.storage_reports import CostWithImages, StatusAllWithVolumes


def cluster_cost(s: Session, c: ClusterRecord, now: float) -> tuple[ClusterCost, int]:
    """Uptime and dollars by the cluster's billing rule: EC2's (per second, 60 s minimum, spot
    piecewise, EBS storage) or seconds x the set rate for machines nobody rents by the second."""
    instances = s.ledger.instances(c.id)
    compute = storage = savings = 0.0
    # A recovered cluster had several generations of instances: its uptime spans them all, its
    # rate is what runs now (or ran last).
    # Once all ended: the last generation's rate (every node of it, not one).
    live = [i for i in instances if i.state not in ENDED_STATES] or instances[-max(c.spec.nodes, 1):]
    rate = sum(i.usd_per_hour for i in live)
    ends = [i.terminated_at or c.terminated_at or now for i in instances]
    uptime = max(ends) - min(i.launched_at for i in instances) if instances else 0.0
    for inst, end in zip(instances, ends):
        seconds = max(0.0, end - inst.launched_at)
        if c.spec.billing == "per-second":
            steps = list(inst.price_steps) or [(inst.launched_at, inst.usd_per_hour)]
            periods = [(a, b if b is not None else end) for a, b in inst.periods] or [(inst.launched_at, end)]
            free = billing.interruption_is_free(inst.market, inst.state_reason, inst.launched_at, inst.terminated_at)
            usd = 0.0 if free else billing.compute_cost(periods, steps)
            compute += usd
            # The volume is billed while the instance is stopped too: storage covers the whole life.
            storage += billing.storage_cost(c.spec.billed_storage_gb, inst.launched_at, end)
            if inst.market == "spot" and inst.on_demand_usd_per_hour:
                billed = sum(billing.billed_seconds(a, b) for a, b in periods)
                savings += billed * inst.on_demand_usd_per_hour / 3600.0 - usd
        else:
            compute += seconds * inst.usd_per_hour / 3600.0
    cost = ClusterCost(id=c.id, name=c.name, provider=c.provider, state=c.state, uptime_s=uptime, usd_per_hour=rate,
                       usd=compute + storage, compute_usd=compute, storage_usd=storage,
                       spot_savings_usd=savings if savings else None)
    return cost, len(instances)


def named(records: list[ClusterRecord], cluster: str) -> list[ClusterRecord]:
    """`--cluster NAME` (status, cost): every cluster of that name, its earlier, released namesakes
    too; NotFoundError when there is none."""
    records = [c for c in records if c.name == cluster]
    if not records:
        raise NotFoundError(f"no cluster named {cluster!r}", "Run `gpuctl status` to list clusters.")
    return records


HIDE_RELEASED_AFTER_S = 7 * 86400  # plain `status` leaves out clusters released longer ago than this


def status(s: Session, run_id: str | None = None, cluster: str | None = None, everything: bool = False) -> StatusReport:
    """Every cluster and run (or one run and its cluster, or one cluster's name and its runs):
    state, epoch k of N, last metrics, elapsed, cost so far. Clusters released over a week ago
    (and their runs) are left out and counted, unless `everything` or one is named."""
    s.connect_quickly()
    only_run = s.find_run(run_id) if run_id is not None else None  # before any host is asked
    records = s.ledger.clusters()
    hidden = 0
    if not everything and run_id is None and cluster is None:
        since = time.time() - HIDE_RELEASED_AFTER_S
        shown = [c for c in records if c.state != "down" or (c.terminated_at or c.created_at) > since]
        hidden, records = len(records) - len(shown), shown
    if cluster is not None:
        records = named(records, cluster)
    if only_run is not None:
        records = [c for c in records if c.id == only_run.cluster_id]
    wanted = {c.id for c in records}
    clusters.reconcile_live(s)
    # Read again: reconciling may have closed a cluster the provider ended.
    records = [c for c in s.ledger.clusters() if c.id in wanted]
    now = time.time()
    out = [cluster_status(s, c, now) for c in records]
    runs = []
    for r in s.ledger.runs():
        if r.cluster_id not in wanted or (only_run is not None and r.run_id != only_run.run_id):
            continue  # filtered before its host is asked
        runs.append(run_status(s, run_state.refresh_or_keep(s, r), now))
    notebooks = notebook_state.sessions(s, records, now)
    return StatusReport(clusters=tuple(out), runs=tuple(runs), hidden_clusters=hidden, notebooks=notebooks,
                        notes=tuple(s.notes))


def cluster_status(s: Session, c: ClusterRecord, now: float) -> ClusterStatus:
    """One cluster's line in `status`: its dollars, its guards as its watchdog wrote them."""
    cost, n = cluster_cost(s, c, now)
    reasons = {i.state_reason for i in s.ledger.instances(c.id) if i.state_reason} if n else set()
    return ClusterStatus(**cost.model_dump(), is_default=c.is_default, instances=n,
                         guard=guards.status_of(s, c) if c.state == "up" and n else None,
                         note="; ".join(sorted(reasons)) or None,
                         setup_failed=setup.failed(s, c) if c.state == "up" else None)


def run_status(s: Session, r: RunRecord, now: float) -> RunStatus:
    """One run's line in `status` (the run as looked at already: run_state.refresh_or_keep)."""
    # Only its last epoch is shown: every epoch is read (and validated) only for a run whose
    # stretches on its instances need their ends (the work an interruption threw away).
    epochs = s.ledger.epochs(r.run_id) if r.segments else None
    last = (epochs[-1] if epochs else None) if epochs is not None else s.ledger.last_epoch(r.run_id)
    elapsed, usd, segs = on_instance(s, r, epochs or [], now)
    return RunStatus(
        run_id=r.run_id, cluster=r.cluster, state=r.state, exit_code=r.exit_code,
        epoch=last.epoch if last else 0, epochs_planned=r.epochs_planned,
        metrics=last.metrics if last else {}, elapsed_s=elapsed, usd=usd,
        log_tail=run_state.log_tail(s, r, 5) if r.state in ("failed", "lost") else None,
        tensorflow=r.tensorflow, image=r.image, code=r.code,
        resumable=r.state in RESUMABLE and _resumable(s, r, last is not None),
        segments=segs, node_states=r.node_states, failed_node=r.failed_node,
        queue_position=r.queue_position if r.state == "queued" else None, usd_per_hour=r.usd_per_hour,
        packages=r.packages, packages_s=r.packages_s, data=r.data, data_fetch_s=r.data_fetch_s,
        data_fetch_bytes=r.data_fetch_bytes,
    )


def _resumable(s: Session, run: RunRecord, reported: bool) -> bool:
    """Whether `train --resume` has a checkpoint to continue the run from: in its cluster's store,
    or in its run dir on its cluster's host (where `train --resume` looks). A place that cannot be
    asked (a lost host, no credentials): whether the run reported an epoch (each one checkpoints)."""
    # Imported here, as in everything(): resume and release bring the push, packages and sync
    # code, which a report (status, cost) of ended runs never runs (issue 39: tens of ms a report).
    from gpuctl.ops.resume import has_checkpoint, in_store
    from gpuctl.remote import jobs

    live = s.live_cluster_of(run)
    if live is None and run.state != "preempted":
        return False
    try:
        if in_store(s, run):
            return True
        if live is None:
            return False
        return has_checkpoint(s.host(live)[1], jobs.JobPaths(run.run_dir))
    except GpuctlError:
        return reported


def everything(s: Session) -> StatusAllWithVolumes:
    """`status --all`: every cluster and run the ledger holds, and every resource each provider
    finds by itself, ledger or not. A ledger that cannot be read still gets the providers' answer
    (which says so)."""
    from gpuctl.ops import release, snapshots, volumes
    from gpuctl.ops.snapshots import SnapshotStorage
    from gpuctl.ops.storage_reports import StatusAllWithVolumes
    from gpuctl.ops.volumes import VolumeStorage

    resources: list[Resource] = []
    notes: list[str] = []
    known = release.live_in_ledger(s, notes.append)
    for name in PROVIDERS:
        try:
            resources += release.searcher(s, name).discover()
        except GpuctlError as exc:
            if any(c.provider == name for c in known):
                raise
            notes.append(f"{name}: not searched: {exc.message}")
    others = [r.id for r in resources if r.cluster is None]  # no cluster of this install: another owner's
    if others:
        notes.append(f"{len(others)} resource(s) belong to another owner (a lost gpuctl home, a colleague; their "
                     f"state says whose): {', '.join(others[:4])}{', ...' if len(others) > 4 else ''}; "
                     "`gpuctl down --all --any-owner` releases them")
    try:
        report = status(s, everything=True)
    except ConfigError:
        report = StatusReport(clusters=(), runs=())
    try:
        kept = volumes.storage(s)
    except ConfigError:  # an unreadable ledger: the providers' answer still comes
        kept = VolumeStorage()
    try:
        data = snapshots.storage(s)
    except ConfigError:
        data = SnapshotStorage()
    return StatusAllWithVolumes(resources=tuple(resources), ledger_clusters=tuple(c.name for c in known),
                                notes=tuple(notes) + report.notes,
                                clusters=report.clusters, runs=report.runs, volumes=kept, data=data)


def on_instance(s: Session, run: RunRecord, epochs: list[EpochReport], now: float,
                instances: list[InstanceRecord] | None = None) -> tuple[float, float, tuple[SegmentCost, ...]]:
    """(seconds, dollars, stretches) of the run's whole time on its instances, start-up included:
    what `status` shows, and what `cost` counts for a run that reports no epochs. `instances`: its
    cluster's, where the caller read them already (else read here)."""
    if run.state == "queued":  # not started: no time, no dollars yet (its start moves past the wait)
        return 0.0, 0.0, ()
    elapsed = max(0.0, (run.ended_at or now) - run.started_at)
    segs = _segments(s, run, epochs, now, instances)
    return elapsed, sum(g.usd for g in segs) if segs else elapsed * run.usd_per_hour / 3600.0, segs


def _segments(s: Session, run: RunRecord, epochs: list[EpochReport], now: float,
              instances: list[InstanceRecord] | None) -> tuple[SegmentCost, ...]:
    if not run.segments:
        return ()
    if instances is None:
        try:
            instances = s.ledger.instances(run.cluster_id)
        except KeyError:
            instances = []
    return segment_costs(run, epochs, {i.id: i for i in instances}, now)


FREE_SHARE = 0.01  # epochs' dollars below this share of the run's time on its instances are not believed


def _with_segments(s: Session, rc: RunCost, run: RunRecord, epochs: list[EpochReport], now: float,
                   instances: list[InstanceRecord]) -> RunCost:
    """Every instance the run used, what an interruption threw away, the waits between them; for
    a run that reported no epoch, its dollars are its whole time on the instance (it ran: a custom
    loop without the report API, or one still in its first epoch, is never $0)."""
    elapsed, usd, segs = on_instance(s, run, epochs, now, instances)
    if elapsed > 0 and (not rc.epochs_done or rc.spent_usd < FREE_SHARE * usd):
        # Epochs that say they cost (next to) nothing, under 1% of the run's time on its
        # instances (the instance is untrusted), count as no report: that time, by this machine's
        # clock, is what it cost.
        rc = rc.model_copy(update={"spent_usd": usd, "spent_from": "wall time", "wall_s": elapsed})
        if rc.epochs_done:
            mean = usd / rc.epochs_done
            rc = rc.model_copy(update={"mean_epoch_usd": mean} | ({
                "projected_total_usd": mean * rc.epochs_planned,
                "projected_remaining_usd": mean * max(rc.epochs_planned - rc.epochs_done, 0)}
                if rc.epochs_planned else {}))
    if not segs:
        return rc
    return rc.model_copy(update={"segments": segs, "instances_usd": sum(g.usd for g in segs),
                                 "lost_s": sum(g.lost_s for g in segs), "lost_usd": sum(g.lost_usd for g in segs),
                                 "waited_s": sum(g.waited_s for g in segs)})


def _machine(s: Session, cluster_id: int, instances: list[InstanceRecord]) -> dict[str, Any]:
    """Which machine a run's dollars bought: its cluster's instance type (else its provider) and market."""
    if not instances:
        return {}
    inst = instances[0]
    return {"instance_type": inst.instance_type or s.ledger.cluster(cluster_id).provider, "market": inst.market}


def cost(s: Session, run_ids: tuple[str, ...] = (), compare: bool = False, cluster: str | None = None,
         rows_of_last: int | None = None, each_run: Callable[[RunCost], None] | None = None) -> CostWithImages:
    """Every cluster's spend, and every run's (or only the named runs') epochs and projection;
    with compare, the named runs side by side (two or more); with `cluster`, only the clusters of
    that name and their runs (as `status --cluster`). With `rows_of_last` N, only the last N runs
    keep their per-epoch rows (a table that shows no more), every run its figures. With
    `each_run`, every run's cost, rows and all, goes to it as soon as it is made, in the report's
    order, and the report keeps the run without its rows (`cost --json` writes each run away at
    once: a run's rows are held only while it is written, whatever the number of runs)."""
    from gpuctl.ops import checkpoints, images, snapshots, volumes
    from gpuctl.ops.storage_reports import CostWithImages

    s.connect_quickly()
    if compare and len(run_ids) < 2:
        raise ConfigError("--compare needs at least two runs", "Name two or more: gpuctl cost --compare RUN1 RUN2")
    wanted = {c.id for c in named(s.ledger.clusters(), cluster)} if cluster is not None else None
    clusters.reconcile_live(s)
    runs = [run_state.refresh_or_keep(s, r) for r in ([s.find_run(r) for r in run_ids] if run_ids else s.ledger.runs())
            if wanted is None or r.cluster_id in wanted]  # filtered before its host is asked
    now = time.time()
    instances: dict[int, list[InstanceRecord]] = {}  # by cluster: read once, not once per run
    machines: dict[int, dict[str, Any]] = {}  # likewise
    first_rows = 0 if rows_of_last is None else max(len(runs) - rows_of_last, 0)
    kept: list[RunCost] = []
    for n, r in enumerate(runs):
        rc = one_run_cost(s, r, now, instances, n >= first_rows or each_run is not None, machines)
        if each_run is not None:
            each_run(rc)
            rc = rc.model_copy(update={"epochs": ()})
        kept.append(rc)
    costs = tuple(kept)
    in_epochs: dict[int, float] = {}
    for r, rc in zip(runs, costs):
        in_epochs[r.cluster_id] = in_epochs.get(r.cluster_id, 0.0) + rc.spent_usd
    out = []
    shown = [c for c in s.ledger.clusters() if wanted is None or c.id in wanted]
    notebooks = notebook_state.sessions(s, shown, now) if not run_ids else ()
    for c in shown:
        cc = cluster_cost(s, c, now)[0]
        out.append(cc if run_ids else cc.model_copy(update={"idle_usd": max(0.0, cc.usd - in_epochs.get(c.id, 0.0))}))
    return CostWithImages(clusters=tuple(out), runs=costs, total_usd=sum(c.usd for c in out), notebooks=notebooks,
                          images=images.storage(s, now), checkpoints=checkpoints.storage(s), notes=tuple(s.notes),
                          volumes=volumes.storage(s, now), data=snapshots.storage(s, now))


def one_run_cost(s: Session, run: RunRecord, now: float, instances: dict[int, list[InstanceRecord]],
                 rows: bool = True, machines: dict[int, dict[str, Any]] | None = None) -> RunCost:
    """A run's epochs and projection, its machine and its stretches: its epochs read (and
    validated) once, its cluster's instances once per `cost` (and its machine, with `machines`)."""
    mine = instances.get(run.cluster_id)
    if mine is None:
        mine = instances[run.cluster_id] = s.ledger.instances(run.cluster_id)
    machine = None if machines is None else machines.get(run.cluster_id)
    if machine is None:
        machine = _machine(s, run.cluster_id, mine)
        if machines is not None:
            machines[run.cluster_id] = machine
    epochs = s.ledger.epochs(run.run_id)
    return _with_segments(s, run_cost(run, epochs, rows, machine), run, epochs, now, mine)


def _rate_at(run: RunRecord, at: float) -> float:
    """The $/h this machine gave the run for the stretch it was in at `at` (the latest, failing that)."""
    if not run.segments:
        return run.usd_per_hour
    inside = [g for g in run.segments if g.started_at <= at and (g.ended_at is None or at <= g.ended_at)]
    return inside[-1].usd_per_hour if inside else run.usd_per_hour


_ROW_FIELDS = set(EpochRow.model_fields)  # every row is given every field: one set for all of them
_new = object.__new__
_set = object.__setattr__


def _row(e: EpochReport, usd: float, cumulative: float) -> EpochRow:
    """An EpochRow of a validated EpochReport's figures and two floats made from them: each value
    is of its field's type already, so the row is set up as pydantic-core sets up a model it
    validated (its __dict__, the fields set, no extra or private attributes), without validating
    it again: 20,000 rows at 1,000 runs x 20 epochs cost a tenth of `cost --json` that way (a
    test checks that validation would make each row the same). Rows share one set of their
    fields' names (pydantic gives each model its own: 728 bytes, more than the rest of a row) and
    their report's metrics (frozen models: nothing changes either)."""
    row = _new(EpochRow)
    _set(row, "__dict__", {
        "epoch": e.epoch, "seconds": e.seconds, "examples": e.examples, "examples_per_s": e.examples_per_s,
        "epoch_cost_usd": usd, "cumulative_usd": cumulative, "metrics": e.metrics,
        "gpu_util_percent": e.gpu_util_percent, "gpu_memory_used_mib": e.gpu_memory_used_mib})
    _set(row, "__pydantic_fields_set__", _ROW_FIELDS)
    _set(row, "__pydantic_extra__", None)
    _set(row, "__pydantic_private__", None)
    return row


def run_cost(run: RunRecord, epochs: list[EpochReport], rows: bool = True,
             machine: dict[str, Any] | None = None) -> RunCost:
    """Per-epoch rows plus the projection: mean epoch cost x planned epochs. An epoch costs what
    its report says (the instance may know a newer spot price), but never less than its seconds at
    the run's own rate: a report cannot make an epoch, or the run's projection, free. Without
    `rows`, the same figures and no per-epoch rows (`epochs` empty: a table that shows none)."""
    usds = []
    kept = []
    cumulative = 0.0
    fixed = None if run.segments else run.usd_per_hour  # one rate for every epoch: no stretches
    for e in epochs:
        rate = _rate_at(run, e.end) if fixed is None else fixed
        usd = max(e.epoch_cost_usd, max(e.seconds, e.end - e.start, 0.0) * rate / 3600)
        cumulative += usd
        usds.append(usd)
        if rows:
            kept.append(_row(e, usd, cumulative))
    done = len(usds)
    planned = run.epochs_planned or next((e.epochs_planned for e in reversed(epochs) if e.epochs_planned), None)
    spent = sum(usds)
    mean_usd = spent / done if done else None
    seconds = sum([e.seconds for e in epochs])
    mean_s = seconds / done if done else None
    total = remaining = finish = None
    if mean_usd is not None and planned:
        total = mean_usd * planned
        remaining = mean_usd * max(planned - done, 0)
        finish = epochs[-1].end + (mean_s or 0.0) * max(planned - done, 0)
    examples = sum([e.examples or 0 for e in epochs])
    return RunCost(
        run_id=run.run_id, cluster=run.cluster, state=run.state, usd_per_hour=run.usd_per_hour, epochs_done=done,
        epochs_planned=planned, epochs=tuple(kept), mean_epoch_s=mean_s, mean_epoch_usd=mean_usd, spent_usd=spent,
        projected_remaining_usd=remaining, projected_total_usd=total,
        examples_per_s=examples / seconds if examples and seconds else None,
        usd_per_million_examples=spent / examples * 1e6 if examples else None, projected_finish_at=finish,
        tensorflow=run.tensorflow, image=run.image, code=run.code, data_fetch_s=run.data_fetch_s,
        data_fetch_usd=run.data_fetch_s * run.usd_per_hour / 3600 if run.data_fetch_s is not None else None,
        **(machine or {}),
    )
