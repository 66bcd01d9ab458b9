"""Spend: `status` (what runs, what it has cost so far) and `cost` (per cluster, per run, per epoch,
with projections, the baked images' snapshot storage and the checkpoints' S3 storage). Every cluster `up` ever made is reported
with its own dollars, also after its name was used again."""

from __future__ import annotations

import time

from gpuctl import billing
from gpuctl.errors import ConfigError
from gpuctl.ops import checkpoints, clusters, guards, run_state
from gpuctl.ops.checkpoints import CheckpointStorage
from gpuctl.ops.images import ImageStorage, storage
from gpuctl.ops.resume import RESUMABLE
from gpuctl.ops.segments import segment_costs
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Session
from gpuctl.results import (ClusterCost, ClusterStatus, CostReport, EpochRow, RunCost, RunStatus, SegmentCost,
                            StatusReport)
from gpuctl.types import ENDED_STATES, ClusterRecord, EpochReport, RunRecord


class CostWithImages(CostReport):
    """`cost`: the clusters and runs, and the baked images' storage (a key of its own, so the
    JSON of earlier versions keeps its meaning: total_usd is still the clusters' total)."""

    images: ImageStorage = ImageStorage()
    # The runs' checkpoints kept in the providers' stores (S3), asked of the stores at each `cost`.
    checkpoints: CheckpointStorage = CheckpointStorage()


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
            storage += billing.storage_cost(c.spec.disk_gb, inst.launched_at, end)
            if inst.market == "spot" and inst.on_demand_usd_per_hour:
                billed = sum(billing.billed_seconds(a, b) for a, b in periods)
                savings += billed * inst.on_demand_usd_per_hour / 3600.0 - usd
        else:
            compute += seconds * inst.usd_per_hour / 3600.0
    cost = ClusterCost(id=c.id, name=c.name, provider=c.provider, state=c.state, uptime_s=uptime, usd_per_hour=rate,
                       usd=compute + storage, compute_usd=compute, storage_usd=storage,
                       spot_savings_usd=savings if savings else None)
    return cost, len(instances)


def status(s: Session) -> StatusReport:
    """Every cluster and run: state, epoch k of N, last metrics, elapsed, cost so far."""
    s.connect_timeout_s = s.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S
    clusters.reconcile_live(s)
    now = time.time()
    out = []
    for c in s.ledger.clusters():
        cost, n = cluster_cost(s, c, now)
        reasons = {i.state_reason for i in s.ledger.instances(c.id) if i.state_reason} if n else set()
        out.append(ClusterStatus(**cost.model_dump(), is_default=c.is_default, instances=n,
                                 guard=guards.status_of(s, c) if c.state == "up" and n else None,
                                 note="; ".join(sorted(reasons)) or None))
    runs = []
    for r in run_state.refreshed_runs(s):
        epochs = s.ledger.epochs(r.run_id)
        elapsed = max(0.0, (r.ended_at or now) - r.started_at)
        segs = _segments(s, r, epochs, now)
        runs.append(RunStatus(
            run_id=r.run_id, cluster=r.cluster, state=r.state, exit_code=r.exit_code,
            epoch=epochs[-1].epoch if epochs else 0, epochs_planned=r.epochs_planned,
            metrics=epochs[-1].metrics if epochs else {}, elapsed_s=elapsed,
            usd=sum(g.usd for g in segs) if segs else elapsed * r.usd_per_hour / 3600.0,
            log_tail=run_state.log_tail(s, r, 5) if r.state in ("failed", "lost") else None,
            tensorflow=r.tensorflow, image=r.image,
            resumable=r.state in RESUMABLE and (s.live_cluster_of(r) is not None or r.state == "preempted"),
            segments=segs, node_states=r.node_states, failed_node=r.failed_node,
        ))
    return StatusReport(clusters=tuple(out), runs=tuple(runs))


def _segments(s: Session, run: RunRecord, epochs: list[EpochReport], now: float) -> tuple[SegmentCost, ...]:
    try:
        instances = {i.id: i for i in s.ledger.instances(run.cluster_id)}
    except KeyError:
        instances = {}
    return segment_costs(run, epochs, instances, now)


def _with_segments(s: Session, rc: RunCost, run: RunRecord, now: float) -> RunCost:
    """Every instance the run used, what an interruption threw away, the waits between them."""
    segs = _segments(s, run, s.ledger.epochs(run.run_id), now)
    if not segs:
        return rc
    return rc.model_copy(update={"segments": segs, "instances_usd": sum(g.usd for g in segs),
                                 "lost_s": sum(g.lost_s for g in segs), "lost_usd": sum(g.lost_usd for g in segs),
                                 "waited_s": sum(g.waited_s for g in segs)})


def _with_machine(s: Session, rc: RunCost, cluster_id: int) -> RunCost:
    """Which machine a run's dollars bought: its cluster's instance type and market."""
    instances = s.ledger.instances(cluster_id)
    if not instances:
        return rc
    inst = instances[0]
    return rc.model_copy(update={"instance_type": inst.instance_type or s.ledger.cluster(cluster_id).provider,
                                 "market": inst.market})


def cost(s: Session, run_ids: tuple[str, ...] = (), compare: bool = False) -> CostWithImages:
    """Every cluster's spend, and every run's (or only the named runs') epochs and projection;
    with compare, the named runs side by side (two or more)."""
    s.connect_timeout_s = s.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S
    if compare and len(run_ids) < 2:
        raise ConfigError("--compare needs at least two runs", "Name two or more: gpuctl cost --compare RUN1 RUN2")
    clusters.reconcile_live(s)
    runs = [run_state.refresh_or_keep(s, s.find_run(r)) for r in run_ids] if run_ids else run_state.refreshed_runs(s)
    now = time.time()
    costs = tuple(_with_segments(s, _with_machine(s, run_cost(r, s.ledger.epochs(r.run_id)), r.cluster_id), r, now)
                  for r in runs)
    in_epochs: dict[int, float] = {}
    for r, rc in zip(runs, costs):
        in_epochs[r.cluster_id] = in_epochs.get(r.cluster_id, 0.0) + rc.spent_usd
    out = []
    for c in s.ledger.clusters():
        cc = cluster_cost(s, c, now)[0]
        out.append(cc if run_ids else cc.model_copy(update={"idle_usd": max(0.0, cc.usd - in_epochs.get(c.id, 0.0))}))
    return CostWithImages(clusters=tuple(out), runs=costs, total_usd=sum(c.usd for c in out),
                          images=storage(s, now), checkpoints=checkpoints.storage(s))


def run_cost(run: RunRecord, epochs: list[EpochReport]) -> RunCost:
    """Per-epoch rows plus the projection: mean epoch cost x planned epochs."""
    rows = tuple(
        EpochRow(epoch=e.epoch, seconds=e.seconds, examples=e.examples, examples_per_s=e.examples_per_s,
                 epoch_cost_usd=e.epoch_cost_usd, cumulative_usd=e.cumulative_usd, metrics=e.metrics)
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
        run_id=run.run_id, cluster=run.cluster, state=run.state, usd_per_hour=run.usd_per_hour, epochs_done=done,
        epochs_planned=planned, epochs=rows, mean_epoch_s=mean_s, mean_epoch_usd=mean_usd, spent_usd=spent,
        projected_remaining_usd=remaining, projected_total_usd=total,
        examples_per_s=examples / seconds if examples and seconds else None,
        usd_per_million_examples=spent / examples * 1e6 if examples else None, projected_finish_at=finish,
        tensorflow=run.tensorflow, image=run.image,
    )
