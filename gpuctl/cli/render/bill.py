"""`gpuctl aws billing setup`, `gpuctl cost --billed` (the side-by-side), the learned line of
`cost`, and `gpuctl aws budget ...`. Money and ids never cut; the drift column wraps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from gpuctl.cli.render import Col, cell, console, say, table, usd

if TYPE_CHECKING:
    from gpuctl.model.bill import BilledReport, BudgetState, Learned, TagSetup

SHOWN_STATUS = {"Active": "active", "Inactive": "inactive"}


def tag_setup(result: TagSetup, out: Console | None = None) -> None:
    out = out or console()
    table(out, [Col("tag key"), Col("cost allocation tag")],
          [(cell(t.key), cell(SHOWN_STATUS.get(t.status, t.status)
                              + (" (activated now)" if t.key in result.activated else ""))) for t in result.tags])
    unseen = [t.key for t in result.tags if t.status == "not seen yet"]
    if unseen:
        say(out, f"Not seen yet: {', '.join(unseen)}. AWS lists a key once a resource carried it; run this "
                 "again after the next `gpuctl up`.")
    say(out, "AWS shows these tags in the bill only from activation on (earlier days stay untagged), and a "
             "new key can take up to a day to appear. Then: gpuctl cost --billed")
    say(out, f"{result.requests} Cost Explorer request(s) made ($0.01 each).")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def billed(report: BilledReport, out: Console | None = None) -> None:
    out = out or console()
    if not report.clusters:
        say(out, f"No aws cluster lived between {report.since} and {report.until}.")
    else:
        rows = []
        for c in report.clusters:
            note = ("not billed yet (AWS lags up to a day)" if c.not_billed_yet
                    else f"bill from {c.first_day} only (--since)" if c.from_since else c.drift or "")
            days = c.first_day if c.first_day == c.last_day else f"{c.first_day}..{c.last_day}"
            rows.append((cell(f"{c.name} #{c.cluster_id}"), days, usd(c.billed_usd), usd(c.estimate_usd),
                         usd(c.diff_usd), _pct(c.diff_pct), cell(note)))
        table(out, [Col("cluster"), Col("days", drop=2), Col("billed", True), Col("gpuctl", True),
                    Col("diff", True), Col("diff %", True, drop=1), Col("note", wrap=True)], rows)
        for c in report.clusters:
            if c.parts:
                say(out, f"  {c.name} #{c.cluster_id}: " + ", ".join(
                    f"{p.part} {usd(p.billed_usd)}" + ("" if p.estimate_usd is None else f" (gpuctl {usd(p.estimate_usd)})")
                    for p in c.parts))
    if report.no_cluster_usd:
        say(out, f"gpuctl's resources on no cluster (volumes, images, data sets): {usd(report.no_cluster_usd)}")
    if report.other_usd:
        say(out, f"Tagged with a cluster name this ledger has no cluster of on that day: {usd(report.other_usd)}")
    say(out, f"{report.requests} Cost Explorer requests made ({usd(report.request_usd)} at $0.01 each); "
             f"{report.cached_days} day(s) from the ledger. Unblended cost, {report.since} to {report.until} (UTC).")


def learned(result: Learned, out: Console | None = None) -> None:
    """The line `cost` adds: what the bill showed beyond gpuctl's estimate (none: no line)."""
    if not result.parts:
        return
    out = out or console()
    say(out, f"Billed beyond gpuctl's estimate (cost --billed, since {result.since}): "
             + ", ".join(f"{p.part} {usd(p.billed_usd)}" for p in result.parts))


def budget(state: BudgetState | None, out: Console | None = None) -> None:
    out = out or console()
    if state is None:
        say(out, "No gpuctl budget. Set one: gpuctl aws budget set --monthly-usd N --email ADDR")
        return
    if state.changed:
        say(out, f"Budget {state.name}: {', '.join(state.changed)}.")
    say(out, budget_line(state))
    for a in state.actions:
        ids = f": {', '.join(a.instance_ids) or 'no instances now'}" if a.kind == "stop instances" else ""
        say(out, f"  action {a.kind} ({a.status}){ids}")


def budget_line(state: BudgetState) -> str:
    spent = "-" if state.actual_usd is None else usd(state.actual_usd)
    forecast = "-" if state.forecast_usd is None else usd(state.forecast_usd)
    fired = [a.kind for a in state.actions if a.status.startswith("EXECUTION_SUCCESS")]
    return (f"AWS budget {state.name}: {usd(state.limit_usd)}/month, spent {spent}, forecast {forecast}"
            + (f"; FIRED: {', '.join(fired)} (gpuctl aws budget lift)" if fired else ""))
