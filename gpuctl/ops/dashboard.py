"""The dashboard's use cases: one look at everything (the same results `status --json` and `cost
--json` give), the spend in calendar windows (a pure function), the latest plan, and the two acts
the page offers, through the CLI's own use cases."""

from __future__ import annotations

import datetime as dt
from typing import Iterable

from gpuctl.errors import GpuctlError
from gpuctl.model import billing
from gpuctl.model.dashboard import DashboardView, RunDetail, RunSummary, Spend
from gpuctl.model.records import FINAL_RUN_STATES, InstanceRecord
from gpuctl.model.results import DownResult, StopResult
from gpuctl.model.untrusted import clean
from gpuctl.ops import costs, release, run_state, stop
from gpuctl.ops.latest_plan import last_plan
from gpuctl.ops.session import Session

LOG_LINES = 20


def look(s: Session, now: float, tails: dict[str, tuple[str, str | None]] | None = None
         ) -> tuple[DashboardView, dict[str, RunDetail]]:
    """Everything the page shows, from one look (it acts on nothing: costs' looks record in the
    ledger only); each run's detail apart (its epochs and log tail), so that the view stays small.
    `tails` (run id -> (its state, its log's tail)) is the caller's cache: an ended run's log is
    read once, a live one's at every look."""
    tails = {} if tails is None else tails
    status = costs.status(s)
    cost = costs.cost(s)
    by_id = {rc.run_id: rc for rc in cost.runs}
    summaries, details = [], {}
    for r in status.runs:
        rc = by_id.get(r.run_id)
        summaries.append(RunSummary(status=r, spent_usd=rc.spent_usd if rc else r.usd,
                                    projected_total_usd=rc.projected_total_usd if rc else None,
                                    mean_epoch_usd=rc.mean_epoch_usd if rc else None,
                                    examples_per_s=rc.examples_per_s if rc else None))
        known = tails.get(r.run_id)
        if known is None or known[0] != r.state or r.state not in FINAL_RUN_STATES:
            tail = r.log_tail if r.log_tail is not None else _log_tail(s, r.run_id)
            known = tails[r.run_id] = (r.state, clean(tail) if tail else None)
        details[r.run_id] = RunDetail(status=r, cost=rc, log_tail=known[1])
    instances = [i for c in s.ledger.clusters() for i in s.ledger.instances(c.id)]
    view = DashboardView(generated_at=now, clusters=status.clusters, runs=tuple(summaries),
                         spend=spend(instances, now), total_usd=cost.total_usd,
                         hidden_clusters=status.hidden_clusters, plan=last_plan(s),
                         notes=tuple(dict.fromkeys(status.notes + cost.notes)))
    return view, details


def _log_tail(s: Session, run_id: str) -> str | None:
    """A running run's last lines; None where its host does not answer now (the next look tries again)."""
    try:
        return run_state.log_tail(s, s.find_run(run_id), LOG_LINES)
    except GpuctlError:
        return None


def windows(now: float) -> tuple[float, float, float]:
    """The starts of today, this week (Monday) and this month, in this machine's local time."""
    today = dt.datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
    week = today - dt.timedelta(days=today.weekday())
    return today.timestamp(), week.timestamp(), today.replace(day=1).timestamp()


def spend(instances: Iterable[InstanceRecord], now: float) -> Spend:
    """Instance dollars since each window's start: every running period of every instance, cut at
    the window's start, priced by its price steps (no 60 s minimum: that is a whole period's)."""
    starts = windows(now)
    totals = [0.0, 0.0, 0.0]
    for inst in instances:
        end = inst.terminated_at or now
        steps = list(inst.price_steps) or [(inst.launched_at, inst.usd_per_hour)]
        periods = [(a, b if b is not None else end) for a, b in inst.periods] or [(inst.launched_at, end)]
        for k, start in enumerate(starts):
            totals[k] += sum(billing.integrate(max(a, start), b, steps) for a, b in periods)
    return Spend(today_usd=totals[0], week_usd=totals[1], month_usd=totals[2])


def stop_run(s: Session, run_id: str) -> StopResult:
    """The page's Stop: `gpuctl stop RUN`."""
    return stop.stop(s, run_id)


def release_cluster(s: Session, name: str) -> DownResult:
    """The page's Release: `gpuctl down NAME`."""
    return release.down(s, name)
