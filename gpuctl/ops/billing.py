"""The bill itself: gpuctl's tags as cost allocation tags (`gpuctl aws billing setup`) and
`gpuctl cost --billed`, Cost Explorer's daily unblended cost of each cluster beside gpuctl's own
estimate (docs/billing.md).

Each Cost Explorer request costs $0.01, so its answers are kept in the ledger: a settled day (its
end more than AWS's lag ago) is never asked again, a recent one again after REASK_S or with
--refresh, and one command makes one request (one page) for the span of days it lacks. Clusters are
told apart by the days they lived: the bill's rows carry the gpuctl:cluster tag, a name `up` may
give again after `down`; a day two namesakes both lived on is split by the hours each lived then.
A look: it writes the answer to the ledger, changes nothing in the cloud."""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict

from gpuctl.errors import BillingError
from gpuctl.model.bill import BilledCluster, BilledDay, BilledPart, BilledReport, BilledRow, Learned, TagSetup, part
from gpuctl.model.records import ClusterRecord
from gpuctl.ops.costs import cluster_cost
from gpuctl.ops.session import Session
from gpuctl.provision.bill import TAG_KEYS, CostExplorer, cost_explorer

DAY_S = 86400.0
LAG_S = DAY_S  # AWS's data lags by up to a day
REASK_S = 6 * 3600.0  # Cost Explorer refreshes a few times a day: a recent day's answer serves this long
DRIFT_PCT = 5.0  # billed and estimated further apart than this: the row says which part
DEFAULT_DAYS = 30  # `--since` by default: this many days back
MAX_DAYS = 395  # Cost Explorer's daily data reaches about 13 months back


def setup(s: Session) -> TagSetup:
    """Activate every gpuctl tag key AWS has seen and that is not active yet; each key's state."""
    ce = cost_explorer(s.settings().settings.aws.profile)
    states = ce.tag_states(TAG_KEYS)
    activated = ce.activate(tuple(t.key for t in states if t.status == "Inactive"))
    shown = tuple(t.model_copy(update={"status": "Active"}) if t.key in activated else t for t in states)
    return TagSetup(tags=shown, activated=tuple(activated), requests=ce.requests)


def _date(t: float) -> dt.date:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).date()


def _start_of(day: str) -> float:
    return dt.datetime.combine(dt.date.fromisoformat(day), dt.time(), dt.timezone.utc).timestamp()


def settled(day: str, now: float) -> bool:
    """Whether AWS's figure for the day is in: its end longer than the lag ago."""
    return _start_of(day) + DAY_S + LAG_S <= now


def not_billed_yet(last: float, now: float) -> bool:
    """Whether a cluster that lived until `last` may still be missing from the bill: its last day
    is not settled (the rule that decides which days are asked again)."""
    return not settled(_date(last).isoformat(), now)


def days_between(start: dt.date, end: dt.date) -> list[str]:
    return [(start + dt.timedelta(days=i)).isoformat() for i in range((end - start).days)]


def first_day(since: dt.date | None, now: float) -> dt.date:
    return since or _date(now) - dt.timedelta(days=DEFAULT_DAYS)


def to_ask(days: list[str], kept: dict[str, float], now: float, refresh: bool) -> list[str]:
    """The days Cost Explorer must answer: never asked, or not settled and asked too long ago (or
    --refresh). A settled day once asked is never asked again."""
    return [d for d in days if d not in kept
            or (not settled(d, now) and (refresh or now - kept[d] >= REASK_S))]


def billed(s: Session, since: dt.date | None = None, refresh: bool = False, now: float | None = None) -> BilledReport:
    now = time.time() if now is None else now
    start, end = first_day(since, now), _date(now) + dt.timedelta(days=1)
    days = days_between(start, end)
    kept = s.ledger.billed_days(days[0], days[-1] + "~")
    need = to_ask(days, kept, now, refresh)
    clusters = [c for c in s.ledger.clusters() if c.provider == "aws" and _lived(c, now, start)]
    requests, asked = 0, []
    if need:
        ce = cost_explorer(s.settings().settings.aws.profile)
        asked = days[days.index(need[0]):days.index(need[-1]) + 1]
        rows = ce.daily(asked[0], (dt.date.fromisoformat(asked[-1]) + dt.timedelta(days=1)).isoformat())
        if not any(r.cluster for r in rows) and any(_lived_on(c, d, now) for c in clusters for d in asked
                                                     if settled(d, now)):
            _check_tags(ce)  # raises where the tags are not active: such an answer is not kept
        requests = ce.requests
        s.ledger.put_billed(asked, rows, now)
    report = side_by_side(s, s.ledger.billed(days[0], days[-1] + "~"), clusters, now, start)
    return report.model_copy(update={"since": start.isoformat(), "until": days[-1], "requests": requests,
                                     "request_usd": round(requests * 0.01, 2),
                                     "cached_days": len(days) - len(asked)})


def _check_tags(ce: CostExplorer) -> None:
    inactive = [t for t in ce.tag_states(TAG_KEYS) if t.key != "gpuctl:owner" and t.status != "Active"]
    if inactive:
        names = ", ".join(f"{t.key} ({t.status})" for t in inactive)
        raise BillingError(f"the bill has no gpuctl rows: cost allocation tags not active: {names}",
                           "Run `gpuctl aws billing setup`; AWS shows a tag in the bill only from its activation "
                           "on, and a new key can take up to a day to appear.")


def _lived(c: ClusterRecord, now: float, start: dt.date) -> bool:
    return (c.terminated_at or now) >= _start_of(start.isoformat())


def _overlap(c: ClusterRecord, day: str, now: float) -> float:
    a, b = _start_of(day), _start_of(day) + DAY_S
    return max(0.0, min(b, c.terminated_at or now) - max(a, c.created_at))


def _lived_on(c: ClusterRecord, day: str, now: float) -> bool:
    return _overlap(c, day, now) > 0


def side_by_side(s: Session, rows: list[BilledRow], clusters: list[ClusterRecord], now: float,
                 start: dt.date) -> BilledReport:
    """Each cluster's bill (its days' rows, a shared day split by hours) beside its estimate."""
    share: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # cluster id -> part -> $
    daily: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    no_cluster = other = 0.0
    for r in rows:
        if not r.cluster:
            no_cluster += r.usd
            continue
        lived = {c.id: _overlap(c, r.day, now) for c in clusters if c.name == r.cluster}
        lived = {cid: sec for cid, sec in lived.items() if sec > 0}
        if not lived:
            other += r.usd
            continue
        for cid, sec in lived.items():
            usd = r.usd * sec / sum(lived.values())
            share[cid][part(r.service)] += usd
            d = daily[cid][r.day]
            d[0] += usd
            d[1] = max(d[1], float(r.estimated))
            d[2] = max(d[2], float(len(lived) > 1))
    out = []
    start_s = _start_of(start.isoformat())
    for c in clusters:
        est, _ = cluster_cost(s, c, now)
        parts = share.get(c.id, {})
        counted = {"EC2 compute": est.compute_usd, "EBS": est.storage_usd}
        from_since = c.created_at < start_s  # the bill from --since, the estimate its whole life: no difference
        shown = tuple(BilledPart(part=p, billed_usd=round(usd, 6), estimate_usd=None if from_since else counted.get(p))
                      for p, usd in sorted(parts.items(), key=lambda kv: -kv[1]))
        total = sum(parts.values())
        diff = total - est.usd
        pct = diff / est.usd * 100 if est.usd > 0 else None
        lagging = not_billed_yet(c.terminated_at or now, now)
        drift = None
        if not lagging and not from_since and pct is not None and abs(pct) > DRIFT_PCT:
            drift = _which_part(parts, counted)
        days = tuple(BilledDay(day=d, usd=round(v[0], 6), estimated=bool(v[1]), shared=bool(v[2]))
                     for d, v in sorted(daily.get(c.id, {}).items()))
        out.append(BilledCluster(
            cluster_id=c.id, name=c.name, first_day=_date(max(c.created_at, start_s)).isoformat(),
            last_day=_date(c.terminated_at or now).isoformat(), billed_usd=round(total, 6),
            estimate_usd=round(est.usd, 6), diff_usd=None if from_since else round(diff, 6),
            diff_pct=None if pct is None or from_since else round(pct, 2),
            not_billed_yet=lagging, from_since=from_since, drift=drift, parts=shown, days=days))
    return BilledReport(since=start.isoformat(), until=_date(now).isoformat(), clusters=tuple(out),
                        no_cluster_usd=round(no_cluster, 6), other_usd=round(other, 6))


def _which_part(parts: dict[str, float], counted: dict[str, float]) -> str:
    """The part whose bill is furthest from what gpuctl counted for it."""
    gaps = {p: parts.get(p, 0.0) - counted.get(p, 0.0) for p in set(parts) | set(counted)}
    worst = max(gaps, key=lambda p: abs(gaps[p]))
    if worst not in counted:
        return f"{worst} ${parts[worst]:.2f}, not counted by gpuctl"
    return f"{worst}: billed ${parts.get(worst, 0.0):.2f}, gpuctl counted ${counted[worst]:.2f}"


def learned(s: Session, now: float | None = None) -> Learned:
    """What the kept bill shows beyond gpuctl's estimate, by part, over the clusters whose bill is
    in (asks nothing: only what `cost --billed` kept). `cost` prints it on a line of its own."""
    now = time.time() if now is None else now
    kept = s.ledger.billed_days("0000", "9999")
    if not kept:
        return Learned()
    first = min(kept)
    start = dt.date.fromisoformat(first)
    clusters = [c for c in s.ledger.clusters() if c.provider == "aws" and _lived(c, now, start)]
    report = side_by_side(s, s.ledger.billed(first, "9999"), clusters, now, start)
    beyond: dict[str, float] = defaultdict(float)
    for c in report.clusters:
        if c.not_billed_yet or c.from_since:
            continue
        for p in c.parts:
            gap = p.billed_usd - (p.estimate_usd or 0.0)
            if gap > 0.005 and p.part != "EC2 compute":
                beyond[p.part] += gap
    return Learned(since=first, parts=tuple(BilledPart(part=p, billed_usd=round(v, 6))
                                            for p, v in sorted(beyond.items(), key=lambda kv: -kv[1])))
