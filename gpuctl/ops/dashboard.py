"""The dashboard's use cases: its looks (what `status --json` and `cost --json` say, per cluster
and run), the spend in calendar windows (a pure function), and the two acts the page offers,
through the CLI's own use cases.

A look is incremental: a run whose ledger key (its record, its epochs) and whose cluster's state
did not move since the last look, and which has ended, is not read or computed again; its JSON is
kept. So an update costs what changed (a live run, a new epoch), not the whole ledger."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import zlib
from dataclasses import dataclass
from typing import Iterable

from gpuctl.errors import GpuctlError, RemoteError
from gpuctl.ledger.keys import run_keys
from gpuctl.model import billing
from gpuctl.model.dashboard import DashboardView, Machine, RunDetail, RunSummary, Spend
from gpuctl.model.records import FINAL_RUN_STATES, InstanceRecord
from gpuctl.model.results import DownResult, StopResult
from gpuctl.model.untrusted import clean
from gpuctl.ops import clusters, costs, release, run_state, stop
from gpuctl.ops.latest_plan import last_plan
from gpuctl.ops.session import Session

LOG_LINES = 20


@dataclass(frozen=True)
class Looked:
    """One look, rendered: the view's JSON, each run's detail JSON, the run a page shows first,
    and a digest that moves when anything the page shows does (a live cluster's dollars and a
    running run's time move with the clock; a ledger of ended things stays still)."""

    view: bytes
    details: dict[str, bytes]
    default_run: str
    digest: bytes


# An ended run's line is kept while its key stands, but computed again after KEEP_S to KEEP_S x 2
# (spread by its id, so a thousand runs do not all come due in one look): what it shows that its
# key does not cover (whether it is resumable: its checkpoint store and host; its log's tail from
# a host that did not answer) is never older than that. A tail not read is tried again sooner.
KEEP_S = 60.0
RETRY_TAIL_S = 10.0


@dataclass(frozen=True)
class _Kept:
    key: tuple[object, ...]
    final: bool  # ended: kept until its key moves or `until`
    until: float
    state: str
    summary: bytes
    detail: bytes
    digest: bytes


class Looker:
    """One dashboard's looks; remembers what each run showed (see the module's docstring)."""

    def __init__(self) -> None:
        self.kept: dict[str, _Kept] = {}
        self.rebuilt = 0  # runs computed by the last look (the bench and a test read it)

    def look(self, s: Session, now: float) -> Looked:
        """Everything the page shows. It acts on nothing: like `status`, it records what it saw."""
        s.connect_quickly()
        clusters.reconcile_live(s)
        records = s.ledger.clusters()
        since = now - costs.HIDE_RELEASED_AFTER_S
        shown = [c for c in records if c.state != "down" or (c.terminated_at or c.created_at) > since]
        by_id = {c.id: c for c in shown}
        cluster_rows = tuple(costs.cluster_status(s, c, now) for c in shown)
        instances = {c.id: s.ledger.instances(c.id) for c in records}
        # `cost`'s total: the shown clusters' dollars were just computed; the hidden ones' added.
        total = sum(c.usd for c in cluster_rows) + sum(costs.cluster_cost(s, c, now)[0].usd
                                                      for c in records if c.id not in by_id)
        kept, self.rebuilt = {}, 0
        for rid, key in run_keys(s.ledger).items():
            cluster = by_id.get(key[0])
            if cluster is None:
                continue  # its cluster is hidden (released over a week ago), as in `status`
            full = (*key, cluster.state, cluster.terminated_at)
            old = self.kept.get(rid)
            fresh = old is not None and old.final and old.key == full and now < old.until
            new = old if fresh else self._run(s, rid, full, now, instances, old)
            if new is not None:
                kept[rid] = new
        self.kept = kept
        machines = {str(c.id): _machine(c.spec.nodes, instances[c.id]) for c in shown}
        view = DashboardView(generated_at=now, clusters=cluster_rows, runs=(), machines=machines,
                             spend=spend([i for mine in instances.values() for i in mine], now), total_usd=total,
                             hidden_clusters=len(records) - len(shown), plan=last_plan(s),
                             notes=tuple(dict.fromkeys(s.notes)))
        rest = view.model_dump_json(exclude={"runs", "generated_at"}).encode()
        body = b'{"generated_at":%s,"runs":[%s],%s' % (json.dumps(now).encode(),
                                                      b",".join(k.summary for k in kept.values()), rest[1:])
        digest = hashlib.sha256(rest + b"".join(k.digest for k in kept.values())).digest()
        live = [rid for rid, k in kept.items() if k.state == "running"]
        return Looked(view=body, details={rid: k.detail for rid, k in kept.items()},
                      default_run=(live or list(kept) or [""])[-1], digest=digest)

    def _run(self, s: Session, run_id: str, key: tuple[object, ...], now: float,
             instances: dict[int, list[InstanceRecord]], old: _Kept | None) -> _Kept | None:
        self.rebuilt += 1
        record = s.ledger.run(run_id)
        if record is None:
            return None  # removed (`runs rm`) since its key was read
        r = run_state.refresh_or_keep(s, record)
        status = costs.run_status(s, r, now)
        rc = costs.one_run_cost(s, r, now, instances)
        summary = RunSummary(status=status, spent_usd=rc.spent_usd, projected_total_usd=rc.projected_total_usd,
                             mean_epoch_usd=rc.mean_epoch_usd, examples_per_s=rc.examples_per_s)
        # An ended run's log is read once (it does not change), a live one's at every look.
        final = r.state in FINAL_RUN_STATES
        kept_tail = RunDetail.model_validate_json(old.detail).log_tail if old is not None else None
        if old is not None and old.final and final and old.state == r.state and kept_tail is not None:
            tail: str | None = kept_tail
        else:
            text = status.log_tail if status.log_tail is not None else _log_tail(s, r.run_id)
            tail = clean(text) if text is not None else None
        detail = RunDetail(status=status, cost=rc, log_tail=tail).model_dump_json().encode()
        body = summary.model_dump_json().encode()
        spread = 1 + zlib.crc32(run_id.encode()) / 2**32
        until = now + (KEEP_S if tail is not None else RETRY_TAIL_S) * spread
        return _Kept(key=key, final=final, until=until, state=r.state, summary=body, detail=detail,
                     digest=hashlib.sha256(body + detail).digest())


def _machine(nodes: int, instances: list[InstanceRecord]) -> Machine:
    latest = instances[-1] if instances else None
    return Machine(instance_type=latest.instance_type if latest else None, market=latest.market if latest else None,
                   nodes=max(nodes, 1))


def _log_tail(s: Session, run_id: str) -> str | None:
    """A run's last lines ("" for none); None where its host does not answer now (a later look
    tries again)."""
    try:
        return run_state.log_tail(s, s.find_run(run_id), LOG_LINES)
    except RemoteError:
        return None
    except GpuctlError:
        return ""  # no log to read (never written, or gone with its run's files)


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

