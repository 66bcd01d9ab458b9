"""The bill as AWS writes it (Cost Explorer, cost allocation tags) and the account's backstop (an
AWS Budget with actions), as the layers pass them: `gpuctl aws billing setup`, `gpuctl cost
--billed`, `gpuctl aws budget ...` (docs/billing.md)."""

from __future__ import annotations

from typing import Literal, Optional

from gpuctl.model.specs import Frozen

# What each Cost Explorer request costs (AWS's price: $0.01 per paginated API request).
REQUEST_USD = 0.01
# The services of a gpuctl cluster's bill, as the rows name them ("EC2 - Other" is EBS volumes and
# snapshots, mostly; data transfer out is billed under its own service).
PARTS = {
    "Amazon Elastic Compute Cloud - Compute": "EC2 compute",
    "EC2 - Other": "EBS",
    "AWS Data Transfer": "data transfer",
    "Amazon Simple Storage Service": "S3",
}


def part(service: str) -> str:
    """The part of a cluster's bill a service is (its own name if gpuctl knows no shorter one)."""
    return PARTS.get(service, service)


class BilledRow(Frozen):
    """One row of Cost Explorer's daily answer: a day, a gpuctl:cluster tag value ("" where the
    resource had none), a service, unblended dollars; estimated: AWS's figure may still change."""

    day: str  # YYYY-MM-DD (UTC)
    cluster: str
    service: str
    usd: float
    estimated: bool = False


class TagState(Frozen):
    key: str
    status: str  # "Active", "Inactive", or "not seen yet" (AWS lists a key once a resource carried it)
    last_updated: Optional[str] = None


class TagSetup(Frozen):
    """`gpuctl aws billing setup`: each of gpuctl's tag keys as a cost allocation tag, and what this
    call activated."""

    tags: tuple[TagState, ...]
    activated: tuple[str, ...] = ()
    requests: int = 0


class BilledPart(Frozen):
    part: str
    billed_usd: float
    estimate_usd: Optional[float] = None  # gpuctl's own figure for that part (compute, EBS), None: not counted


class BilledDay(Frozen):
    day: str
    usd: float
    estimated: bool = False
    shared: bool = False  # a namesake lived that day too: the day's bill split by each one's hours


class BilledCluster(Frozen):
    """One cluster (one `up`, by its ledger id) with its bill beside gpuctl's estimate."""

    cluster_id: int
    name: str
    first_day: str
    last_day: str
    billed_usd: float
    estimate_usd: float
    diff_usd: Optional[float]  # billed - estimate; None where the two span different times (from_since)
    diff_pct: Optional[float] = None  # of the estimate; None where the estimate is 0
    not_billed_yet: bool = False  # its last day not settled (AWS's lag, up to a day after it): the bill is not complete
    from_since: bool = False  # lived before --since: the bill counted from then only
    drift: Optional[str] = None  # where billed and estimate differ by more than DRIFT_PCT: which part
    parts: tuple[BilledPart, ...] = ()
    days: tuple[BilledDay, ...] = ()


class BilledReport(Frozen):
    """`gpuctl cost --billed`."""

    since: str
    until: str  # the last day asked (today, UTC)
    clusters: tuple[BilledCluster, ...]
    no_cluster_usd: float = 0.0  # gpuctl's resources on no cluster (volumes, images, data sets)
    other_usd: float = 0.0  # tagged with a cluster name this ledger has no cluster of that day
    requests: int = 0  # Cost Explorer requests this command made
    request_usd: float = 0.0
    cached_days: int = 0  # days answered from the ledger
    notes: tuple[str, ...] = ()


class Learned(Frozen):
    """What the bill (as cached by `cost --billed`) shows beyond gpuctl's estimate, by part: the
    line `cost` adds to its own figures."""

    parts: tuple[BilledPart, ...] = ()
    since: Optional[str] = None


ActionState = Literal["STANDBY", "PENDING", "EXECUTION_IN_PROGRESS", "EXECUTION_SUCCESS", "EXECUTION_FAILURE",
                      "REVERSE_IN_PROGRESS", "REVERSE_SUCCESS", "REVERSE_FAILURE", "RESET_IN_PROGRESS",
                      "RESET_FAILURE"]


class BudgetAction(Frozen):
    kind: str  # "stop instances" or "deny launches"
    action_id: str
    status: str
    instance_ids: tuple[str, ...] = ()  # stop: the instances it stops
    region: Optional[str] = None


class BudgetState(Frozen):
    """`gpuctl aws budget show` (and set, lift): the budget as AWS has it."""

    name: str
    limit_usd: float
    currency: str = "USD"
    actual_usd: Optional[float] = None
    forecast_usd: Optional[float] = None
    emails: tuple[str, ...] = ()
    actions: tuple[BudgetAction, ...] = ()
    changed: tuple[str, ...] = ()  # what this command did ("created", "limit", "actions", "lifted", ...)


class BudgetGone(Frozen):
    name: str
    removed: bool
