"""`gpuctl plan`: the ranked table, what failed, the hints, the recommendation, and the plan's cost.

Under the width rule of cli/render/__init__.py (money and ids whole) the table drops, in this order: GPU
memory, first epoch, ready, examples/s, GPU %, steady epoch, $/h, the run and its date (history);
it keeps the rank, the machine, the projected time and dollars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from gpuctl.cli.render import Col, clock, console, duration, num, say, table, usd

if TYPE_CHECKING:
    from gpuctl.model.results import PlanReport, PlanRow


def _gpu(row: PlanRow) -> str:
    return "n/a" if row.gpu_util_percent is None else f"{row.gpu_util_percent:.0f}%"


def _memory(row: PlanRow) -> str:
    if row.gpu_memory_used_mib is None:
        return "n/a"
    total = f"/{row.gpu_memory_total_mib / 1024:.0f}" if row.gpu_memory_total_mib else ""
    return f"{row.gpu_memory_used_mib / 1024:.1f}{total} GiB"


def plan(report: PlanReport, out: Console | None = None) -> None:
    out = out or console()
    history = any(r.source == "history" for r in report.rows)
    measured = [r for r in report.rows if r.rank is not None]
    n = report.epochs
    if measured:
        cols = [Col("#", True), Col("machine"), Col("$/h", True, drop=7), Col("ready", True, drop=3),
                Col("1st epoch", True, drop=2), Col("steady", True, drop=6), Col("ex/s", True, drop=4),
                Col("GPU", True, drop=5), Col("GPU mem", True, drop=1), Col(f"time for {n}", True),
                Col(f"$ for {n}", True), Col("", drop=8)]
        if history:
            cols[2:2] = [Col("run", drop=9), Col("when", drop=9)]
        rows = []
        for r in measured:
            cells = [str(r.rank), r.label, usd(r.usd_per_hour), duration(r.ready_s), duration(r.first_epoch_s),
                     duration(r.steady_epoch_s), num(r.examples_per_s), _gpu(r), _memory(r),
                     duration(r.projected_s), usd(r.projected_usd), "fastest" if r.fastest else ""]
            if history:
                cells[2:2] = [r.run_id or "-", clock(r.run_started_at or 0, "%Y-%m-%d")]
            rows.append(cells)
        table(out, cols, rows)
    else:
        say(out, "Nothing was measured.")
    for r in report.rows:
        if r.rank is None:
            say(out, (r.label, "bold"), f": {r.outcome}" + (f": {r.problem}" if r.problem else ""))
    for note in report.notes:
        say(out, f"Hint: {note}.")
    if report.recommendation:
        best = report.rows[0]
        say(out, f"Cheapest for {n} epochs: {best.label}, {usd(best.projected_usd)} in {duration(best.projected_s)} "
                 "(spot interruptions not included):")
        say(out, f"  {report.recommendation}")
    if not history:
        say(out, f"This plan cost {usd(report.plan_usd)} (worst case was {usd(report.worst_case_usd)}); "
                 "`gpuctl cost` lists its probes.")
