"""What EC2 says happened to an instance since gpuctl last looked: state, when and why it ended,
its running periods (a stop and a start make two) and the spot prices over its life. The ledger
closes billing at EC2's times, not the client's."""

from __future__ import annotations

import time
from typing import Any, Callable

from gpuctl.errors import CloudError
from gpuctl.model import billing
from gpuctl.model.records import ENDED_STATES, InstanceRecord
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate
from gpuctl.retry import REAL_CLOCK, Backoff, Clock

EC2_GRACE_S = 150.0  # a notice comes two minutes before the interruption
EC2_POLL_S = 5.0
Instances = list[InstanceRecord]


def transition_time(inst: dict[str, Any]) -> float | None:
    """EC2 says when an instance stopped in StateTransitionReason: 'User initiated (2026-11-30 04:00:00 GMT)'
    (moto writes UTC)."""
    import datetime as dt
    import re

    m = re.search(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)", inst.get("StateTransitionReason", ""))
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()


def running_periods(inst: InstanceRecord, state: str, live: dict[str, Any] | None,
                    ended: float | None) -> tuple[tuple[float, float | None], ...]:
    """The instance's running periods after a state change seen now (a stop and a start make two).

    A stop is closed at EC2's transition time. A start opens at EC2's LaunchTime (which EC2 moves
    on every start); where it did not move past the last stop (moto does not), at the time gpuctl
    saw it running, the best that is known.
    """
    periods = list(inst.periods) or [(inst.launched_at, None)]
    start, end = periods[-1]
    now = time.time()
    if state == "running" and end is not None:
        launch = live["LaunchTime"].timestamp() if live and hasattr(live.get("LaunchTime"), "timestamp") else 0.0
        periods.append((launch if launch > end else now, None))
    elif state != "running" and end is None:
        periods[-1] = (start, max(start, ended or now))
    return tuple(periods)


def spot_steps(ec2: Any, inst: InstanceRecord) -> tuple[tuple[float, float], ...]:
    """The zone's spot prices over the instance's life, as (since, $/h) steps."""
    import datetime as dt

    start = dt.datetime.fromtimestamp(inst.launched_at, dt.timezone.utc)
    end = dt.datetime.fromtimestamp(inst.terminated_at or time.time(), dt.timezone.utc)
    try:
        res = call(ec2.describe_spot_price_history, InstanceTypes=[inst.instance_type], AvailabilityZone=inst.zone,
                   ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"], StartTime=start, EndTime=end)
    except CloudError:
        return ()
    points = sorted((p["Timestamp"].timestamp(), float(p["SpotPrice"])) for p in res.get("SpotPriceHistory", [])
                    if p.get("AvailabilityZone") == inst.zone)
    before = [p for p in points if p[0] <= inst.launched_at]
    after = [p for p in points if p[0] > inst.launched_at]
    # The price in force at launch is the last one published before it.
    return tuple(([(inst.launched_at, before[-1][1])] if before else []) + after)


def _describe(ec2: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    """EC2's view of the instances; one missing from the answer is gone (EC2 forgets terminated
    instances after about an hour). Only "not found" means gone: a network error, throttling or
    expired credentials raise, so a flaky connection never closes a cluster that still runs."""
    try:
        res = ec2.describe_instances(InstanceIds=ids)
    except aws_errors() as exc:
        if not error_code(exc).startswith("InvalidInstanceID.NotFound"):
            raise translate(exc, "DescribeInstances") from exc
        if len(ids) == 1:
            return {}
        found: dict[str, dict[str, Any]] = {}
        for iid in ids:  # which of them is gone: ask for each
            found.update(_describe(ec2, [iid]))
        return found
    return {i["InstanceId"]: i for r in res["Reservations"] for i in r["Instances"]}


GONE = "no longer known to EC2"  # the state reason of an instance DescribeInstances no longer returns


def reconcile(aws_for: Callable[[str | None], Aws], instances: list[InstanceRecord]) -> list[InstanceRecord]:
    """The instances as EC2 sees them now: state, and when and why they ended.

    A guard's poweroff terminates the instance (shutdown behaviour terminate); this is how the
    client learns it, and the ledger closes the billing period at EC2's time, not the client's.
    """
    by_region: dict[str, list[InstanceRecord]] = {}
    for inst in instances:
        by_region.setdefault(inst.region or "", []).append(inst)
    out = []
    for region, items in by_region.items():
        ec2 = aws_for(region or None).ec2()
        seen = _describe(ec2, [i.id for i in items])
        for inst in items:
            live = seen.get(inst.id)
            state = live["State"]["Name"] if live else "terminated"
            if inst.market == "spot" and inst.zone and inst.instance_type and inst.state != "terminated":
                inst = inst.model_copy(update={"price_steps": spot_steps(ec2, inst) or inst.price_steps})
            # A record made as EC2 gave the id (an `up` interrupted then) may predate its addresses.
            found = {"public_ip": (live or {}).get("PublicIpAddress"), "private_ip": (live or {}).get("PrivateIpAddress")}
            missing = {k: v for k, v in found.items() if v and not getattr(inst, k)}
            if missing:
                inst = inst.model_copy(update=missing)
            if state == inst.state:
                out.append(inst)
                continue
            ended = None
            if state in ("terminated", "shutting-down", "stopped", "stopping"):
                ended = transition_time(live) if live else None
            reason = (live or {}).get("StateReason", {}).get("Message") if live else GONE
            out.append(inst.model_copy(update={
                "state": state, "state_reason": reason,
                "terminated_at": (ended or time.time()) if state in ("terminated", "shutting-down") else None,
                "periods": running_periods(inst, state, live, ended),
            }))
    return out


def end_interrupted(instances: Instances, reconcile: Callable[[Instances], Instances],
                    end: Callable[[Instances], Instances], progress: Callable[[str], None],
                    taken: set[str] | None = None, clock: Clock = REAL_CLOCK) -> Instances:
    """A spot instance that heard its notice in its first hour is free if EC2 ends it and billed
    if we do (model/billing.py): EC2 gets its two minutes (and a half) first; whatever still runs
    then is ended (`end`), and at once a node EC2 is not taking (`taken`: those it is)."""
    young = [i for i in instances if i.market == "spot" and (taken is None or i.id in taken)
             and time.time() - i.launched_at < billing.SPOT_FREE_INTERRUPTION_S]
    # The other nodes are ended at once: waiting for EC2 would only bill them longer.
    ended = end([i for i in instances if i not in young])
    left = young
    if young:
        progress(f"letting EC2 end {', '.join(i.id for i in young)} (interrupted in its first hour: not billed "
                 f"when EC2 ends it; up to {EC2_GRACE_S:.0f} s)")
        grace = Backoff(EC2_POLL_S, timeout_s=EC2_GRACE_S, clock=clock)
        while left and not grace.expired():
            grace.pause()
            try:
                fresh = reconcile(left)
            except CloudError:
                continue
            ended += [i for i in fresh if i.state in ENDED_STATES]
            left = [i for i in fresh if i.state not in ENDED_STATES]
    return ended + end(left)
