"""`gpuctl volume ls`, `volume create`, `volume rm`, and the volumes' lines in `cost`, `status --all`
and `down --all`. Under the width rule of cli/render/__init__.py, the ls table drops created,
then where; name, GB, $/month and used by stay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import click
from rich.console import Console

from gpuctl.cli.render import Col, cell, clock, console, notes, say, table, usd

if TYPE_CHECKING:
    from gpuctl.model.results import Kept
    from gpuctl.ops.volumes import VolumeInfo, VolumeList, VolumePlan, VolumeStorage


def _where(v: VolumeInfo) -> str:
    return f"{v.provider} {v.zone or v.host}".strip()


def listing(result: VolumeList, out: Console | None = None) -> None:
    out = out or console()
    notes(result.notes)
    if not result.volumes:
        say(out, "No volumes. Make one: gpuctl volume create NAME --size GB")
        return
    cols = [Col("volume"), Col("where", drop=2), Col("GB", True), Col("$/month", True), Col("used by"),
            Col("created", True, drop=1), Col("id", drop=3)]
    table(out, cols, [(cell(v.name), cell(_where(v)), str(v.size_gb), usd(v.monthly_usd), cell(v.used_by or "-"),
                       clock(v.created_at, "%Y-%m-%d %H:%M"), cell(v.id)) for v in result.volumes])
    total = sum(v.monthly_usd for v in result.volumes)
    say(out, f"{len(result.volumes)} volume(s): {usd(total)}/month at {result.price}. "
             "Use one: gpuctl up --volume NAME; remove one: gpuctl volume rm NAME")


def question(p: VolumePlan) -> str:
    where = f" in {p.where}" if p.where else ""
    return (f"create a {p.size_gb} GB encrypted gp3 volume {p.name!r}{where} ({usd(p.monthly_usd)}/month until "
            f"`gpuctl volume rm {p.name}`)")


def created(v: VolumeInfo) -> None:
    cost = f"{usd(v.monthly_usd)}/month" if v.monthly_usd else "no charge (your own disk)"
    click.echo(f"Volume {v.name}: {v.id} ({v.provider}{f', {v.zone}' if v.zone else ''}"
               f"{f', on {v.host}' if v.host else ''}), {v.size_gb} GB, {cost}.")
    click.echo(f"Next: gpuctl up --volume {v.name}   (its jobs find it at ${_env()}: {v.path})")


def _env() -> str:
    from gpuctl.model.volumes import ENV_VAR

    return ENV_VAR


def removed(v: VolumeInfo) -> None:
    click.echo(f"Removed volume {v.name} ({v.id}, {v.size_gb} GB) and everything on it: {usd(v.accrued_usd)} of "
               "storage while it existed; nothing more from now on.")


def storage(s: VolumeStorage | None, out: Console) -> None:
    """`cost` and `status --all`: the volumes' storage (no cluster's: they outlive them)."""
    if s is None or not s.volumes:
        return
    live = [v for v in s.volumes if v.removed_at is None]
    say(out, f"Volumes: {len(live)} kept, {s.gb:g} GB: {usd(s.usd_per_month)}/month, {usd(s.accrued_usd)} to date"
             f"{f' (with {len(s.volumes) - len(live)} removed)' if len(live) < len(s.volumes) else ''} "
             f"({', '.join(f'{v.name}: {usd(v.accrued_usd)}' for v in s.volumes)}).")


def kept(left: Sequence[Kept]) -> None:
    """`down --all`: what it left (volumes, data sets: they hold data), and how to delete each."""
    for k in left:
        click.echo(f"kept: {k.kind} {k.name} ({k.size}, {usd(k.usd_per_month)}/month); `{k.remove}` deletes it")
