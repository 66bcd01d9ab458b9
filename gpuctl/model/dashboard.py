"""What `gpuctl dashboard` shows: the same typed results the `--json` outputs give, gathered for
one look (one model, two renderings: the CLI's tables and the page)."""

from __future__ import annotations

from typing import Optional

from gpuctl.model.specs import Frozen
from gpuctl.model.results import ClusterStatus, PlanReport, RunCost, RunStatus


class Spend(Frozen):
    """Instance dollars across every cluster in calendar windows of this machine's local time
    (compute by each instance's price steps; storage left out: `gpuctl cost` has it per cluster)."""

    today_usd: float
    week_usd: float  # since Monday 00:00
    month_usd: float  # since the 1st, 00:00


class Machine(Frozen):
    """What a cluster runs on, from its latest instance (`status` shows no type: the page does)."""

    instance_type: Optional[str] = None
    market: Optional[str] = None
    nodes: int = 1


class RunSummary(Frozen):
    """A run's line on the page: its status and, from `cost`, its dollars and projection."""

    status: RunStatus
    spent_usd: float = 0.0
    projected_total_usd: Optional[float] = None
    mean_epoch_usd: Optional[float] = None
    examples_per_s: Optional[float] = None


class DashboardView(Frozen):
    """Everything the page shows at once, but each run's epochs and log (RunDetail)."""

    generated_at: float
    clusters: tuple[ClusterStatus, ...]  # up, then released (the page folds those)
    machines: dict[str, Machine] = {}  # by cluster id (as text: a JSON key)
    runs: tuple[RunSummary, ...]
    spend: Spend
    total_usd: float  # `gpuctl cost`'s total
    hidden_clusters: int = 0  # released over a week ago (`status --all` shows them)
    plan: Optional[PlanReport] = None  # the latest `gpuctl plan`'s report
    notes: tuple[str, ...] = ()  # what the instances sent that was not believed


class RunDetail(Frozen):
    """One run, whole: its epochs' dollars (the chart) and the tail of its log."""

    status: RunStatus
    cost: Optional[RunCost] = None
    log_tail: Optional[str] = None  # control sequences stripped


class ActionResult(Frozen):
    """What a button on the page did, in the CLI's words (or its Error/Hint)."""

    ok: bool
    message: str
    hint: Optional[str] = None
