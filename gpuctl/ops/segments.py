"""A run's stretches on its instances (segments) as the reports count them: what each instance
cost while the run was on it (EC2's rule for interrupted spot instances included), the work an
interruption threw away (after the last checkpointed epoch, done again on the next instance), and
the wait between instances."""

from __future__ import annotations

from gpuctl.model import billing
from gpuctl.model.records import FINAL_RUN_STATES, EpochReport, InstanceRecord, RunRecord
from gpuctl.model.results import SegmentCost

CUT_SHORT = ("preempted", "lost", "failed", "stopped")


def segment_costs(run: RunRecord, epochs: list[EpochReport], instances: dict[str, InstanceRecord],
                  now: float) -> tuple[SegmentCost, ...]:
    """Each segment with its seconds, dollars, lost work and the wait before it."""
    out: list[SegmentCost] = []
    for n, seg in enumerate(run.segments):
        end = seg.ended_at or (run.ended_at if run.state in FINAL_RUN_STATES and run.ended_at else now)
        seconds = max(0.0, end - seg.started_at)
        group = [instances.get(i) for i in seg.instance_ids]
        frees = [inst is not None and billing.interruption_is_free(inst.market, inst.state_reason, inst.launched_at,
                                                                   inst.terminated_at) for inst in group]
        free = all(frees)
        lost_s = 0.0
        resumed_after = n < len(run.segments) - 1
        if seg.ended_at is not None and (resumed_after or seg.end in ("preempted", "lost")) and seg.end in CUT_SHORT:
            done = [e.end for e in epochs if seg.started_at <= e.end <= end]
            lost_s = max(0.0, end - max([seg.started_at, *done]))
        rate = 0.0 if free else seg.usd_per_hour
        if seg.node_ids and None not in group:  # several nodes: EC2 may take one (free) and not another
            rate = sum(0.0 if f else inst.usd_per_hour for inst, f in zip(group, frees) if inst is not None)
        waited = max(0.0, seg.started_at - (run.segments[n - 1].ended_at or seg.started_at)) if n else 0.0
        out.append(SegmentCost(**seg.model_dump(), seconds=seconds, usd=seconds * rate / 3600.0, free=free,
                               lost_s=lost_s, lost_usd=lost_s * rate / 3600.0, waited_s=waited))
    return tuple(out)
