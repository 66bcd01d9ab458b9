"""`gpuctl data push`, `data ls`, `data rm`, and the data sets' line in `cost`. Under the width
rule of cli/render/__init__.py, the ls table drops pushed, then last used; name, files, size and
$/month stay."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.console import Console

from gpuctl.cli.render import Col, cell, clock, console, say, table, usd

if TYPE_CHECKING:
    from gpuctl.ops.snapshots import PushResult, SnapshotInfo, SnapshotList, SnapshotStorage


def _size(n: float) -> str:
    from gpuctl.model.data import size_text

    return size_text(n)


def pushed(r: PushResult) -> None:
    v = r.snapshot
    click.echo(f"Data set {v.name}: {v.files:,} files, {_size(v.bytes)} in s3://{v.bucket}/{v.prefix} "
               f"({r.uploaded:,} uploaded, {_size(r.uploaded_bytes)}; {r.unchanged:,} unchanged; {r.deleted:,} removed; "
               f"{r.seconds:.1f}s). {usd(v.monthly_usd)}/month.")
    click.echo(f"Next: gpuctl train PROJECT --data gpuctl:{v.name}   (each node fetches it in its region)")


def listing(result: SnapshotList, out: Console | None = None) -> None:
    out = out or console()
    if not result.snapshots:
        say(out, "No data sets. Upload one: gpuctl data push DIR --name NAME")
        return
    cols = [Col("data set"), Col("files", True), Col("size", True), Col("$/month", True),
            Col("last used", True, drop=2), Col("pushed", True, drop=1), Col("region", drop=3)]
    table(out, cols, [(cell(v.name if v.complete else f"{v.name} (incomplete)"), f"{v.files:,}", _size(v.bytes), usd(v.monthly_usd),
                       clock(v.last_used_at, "%Y-%m-%d %H:%M") if v.last_used_at else "never",
                       clock(v.pushed_at, "%Y-%m-%d %H:%M"), cell(v.region)) for v in result.snapshots])
    total = sum(v.monthly_usd for v in result.snapshots)
    say(out, f"{len(result.snapshots)} data set(s): {usd(total)}/month at {result.price}. "
             "Train from one: gpuctl train PROJECT --data gpuctl:NAME; remove one: gpuctl data rm NAME")


def removed(v: SnapshotInfo) -> None:
    click.echo(f"Removed data set {v.name} ({v.files:,} files, {_size(v.bytes)}): {usd(v.accrued_usd)} of storage "
               "while it existed; nothing more from now on.")


def storage(s: SnapshotStorage | None, out: Console) -> None:
    """`cost`: the data sets' storage (no cluster's: they outlive them)."""
    if s is None or not s.snapshots:
        return
    live = [v for v in s.snapshots if v.removed_at is None]
    say(out, f"Data sets: {len(live)} kept, {s.gb:.2f} GB: {usd(s.usd_per_month)}/month, {usd(s.accrued_usd)} to date"
             f"{f' (with {len(s.snapshots) - len(live)} removed)' if len(live) < len(s.snapshots) else ''} "
             f"({', '.join(f'{v.name}: {usd(v.accrued_usd)}' for v in s.snapshots)}).")
