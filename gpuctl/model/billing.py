"""How EC2 bills, one small rule per function, so the reports can match the bill.

- Linux instances are billed per second with a 60-second minimum for each running period.
- A spot instance pays the spot price of its zone as it changes: the price is integrated
  piecewise over the running time.
- An EBS volume is billed per GB-month, prorated by the second (a month is 730 hours).
Times are Unix seconds; prices are dollars per hour.
"""

from __future__ import annotations

from typing import Sequence

MIN_BILLED_S = 60.0
HOURS_PER_MONTH = 730.0
GP3_USD_PER_GB_MONTH = 0.08  # us-east-1; the report says it is a list price


def billed_seconds(start: float, end: float) -> float:
    """Seconds billed for one running period: the actual seconds, but at least 60."""
    if end <= start:
        return MIN_BILLED_S if end == start else 0.0
    return max(end - start, MIN_BILLED_S)


def price_at(t: float, steps: Sequence[tuple[float, float]]) -> float:
    """The price in force at time t: the latest step at or before t (the first step before them all)."""
    if not steps:
        return 0.0
    current = steps[0][1]
    for at, usd in steps:
        if at <= t:
            current = usd
        else:
            break
    return current


def integrate(start: float, end: float, steps: Sequence[tuple[float, float]]) -> float:
    """Dollars for running from start to end under a piecewise-constant $/h price."""
    steps = sorted(steps)
    if end <= start or not steps:
        return 0.0
    cuts = [start] + [at for at, _ in steps if start < at < end] + [end]
    return sum((b - a) * price_at(a, steps) / 3600.0 for a, b in zip(cuts, cuts[1:]))


def compute_cost(periods: Sequence[tuple[float, float]], steps: Sequence[tuple[float, float]]) -> float:
    """Dollars for several running periods (a stop and a start make two), each with the 60 s minimum."""
    total = 0.0
    for start, end in periods:
        billed_end = start + billed_seconds(start, end)
        total += integrate(start, billed_end, steps)
    return total


def storage_cost(gb: float, start: float, end: float, usd_per_gb_month: float = GP3_USD_PER_GB_MONTH) -> float:
    """Dollars for a volume of `gb` that existed from start to end (running or stopped alike)."""
    if end <= start:
        return 0.0
    return gb * usd_per_gb_month * (end - start) / (HOURS_PER_MONTH * 3600.0)


# Billing for interrupted Spot Instances (Linux), as AWS documents it:
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/billing-for-interrupted-spot-instances.html
#   If Amazon EC2 interrupts the Spot Instance: in the first hour, no charge; after the first hour,
#   charged for the seconds used. If you stop or terminate it: charged for the seconds used.
# So recovery lets EC2 end an instance interrupted in its first hour rather than ending it itself.
SPOT_FREE_INTERRUPTION_S = 3600.0
SPOT_INTERRUPTION_REASON = "Server.SpotInstanceTermination"  # the state reason code EC2 gives it


def interruption_is_free(market: str, state_reason: str | None, launched_at: float, ended_at: float | None) -> bool:
    """True for a spot instance that Amazon EC2 interrupted within its first hour: not billed."""
    return (market == "spot" and (state_reason or "").startswith(SPOT_INTERRUPTION_REASON)
            and ended_at is not None and ended_at - launched_at < SPOT_FREE_INTERRUPTION_S)


# S3 Standard storage, the first 50 TB a month, us-east-1, as https://aws.amazon.com/s3/pricing/
# lists it (2026-11); S3 bills GB-months of 2^30 bytes, prorated by the hour. What the checkpoint
# bucket costs (`gpuctl cost`); its requests (a few PUTs per epoch) are left out.
S3_STANDARD_USD_PER_GB_MONTH = 0.023
S3_PRICE = f"${S3_STANDARD_USD_PER_GB_MONTH:.3f}/GB-month (S3 Standard list price, us-east-1, 2026-11)"

# Data transfer out of S3 (https://aws.amazon.com/s3/pricing/, "Data Transfer", us-east-1, 2026-11
# list prices): to an EC2 instance in the bucket's region, free; to another region, $0.02/GB; to
# the internet (a lab box, this laptop), $0.09/GB for the first 10 TB a month. GETs cost $0.0004
# per 1,000 on top (10,000 files: $0.004), left out here.
S3_INTER_REGION_USD_PER_GB = 0.02
S3_INTERNET_USD_PER_GB = 0.09


def s3_transfer(bucket_region: str, where: str | None) -> tuple[float, str]:
    """What S3 bills a GB fetched from a bucket in `bucket_region` by a machine in region `where`
    (None: outside AWS), and why, in words."""
    if where is None:
        return S3_INTERNET_USD_PER_GB, "this host is outside AWS, so S3 bills transfer out to the internet"
    if where != bucket_region:
        return S3_INTER_REGION_USD_PER_GB, f"the cluster is in {where}, so S3 bills the crossing between regions"
    return 0.0, "in the cluster's region: no transfer charge"
