"""`gpuctl image ls`, `image bake`, `image rm`: the table and the lines. Under the width rule of
cli/render/__init__.py, the ls table drops base image, then created, then name; id, TF, size and $/month stay."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.console import Console

from gpuctl.cli.render import Col, clock, console, say, table, usd

if TYPE_CHECKING:
    from gpuctl.ops.images import BakeResult, ImageInfo, ImageList


def listing(result: ImageList, out: Console | None = None) -> None:
    out = out or console()
    if not result.images:
        say(out, f"No baked images in {result.region}. Make one: gpuctl image bake --tf 2.21 -y")
        return
    cols = [Col("image"), Col("TF"), Col("packages", drop=2), Col("state"), Col("base image", drop=1),
            Col("created", True, drop=2), Col("GB", True), Col("$/month", True), Col("name", drop=3)]
    table(out, cols, [(i.id, _tf(i), i.packages or "-", i.state, i.base_image or "?",
                       clock(i.created_at, "%Y-%m-%d %H:%M"), f"{i.size_gb:g}", usd(i.usd_per_month), i.name)
                      for i in result.images])
    total = sum(i.usd_per_month for i in result.images)
    say(out, f"{len(result.images)} image(s) in {result.region}: {usd(total)}/month of snapshot storage at "
             f"{result.price}. Remove one: gpuctl image rm AMI_ID -y")
    if any(i.state != "available" for i in result.images):
        say(out, "`up` boots only available images; a pending one is still being made (10-30 minutes), a failed "
                 "one only costs: remove it.")


def _tf(i: ImageInfo) -> str:
    """As asked, the exact version where it says more, and CPU-only where it is (2.21 (2.21.0, CPU))."""
    more = [v for v in (i.tf_installed if i.tf_installed != i.tensorflow else None,
                        "CPU" if i.tf_variant == "cpu" else None) if v]
    return (i.tensorflow or "?") + (f" ({', '.join(more)})" if more else "")


def _image_line(i: ImageInfo) -> str:
    return (f"{i.id} ({i.name}): TensorFlow {_tf(i)}{f' with {i.packages}' if i.packages else ''} on "
            f"{i.base_image or '?'}, {i.size_gb:g} GB, {usd(i.usd_per_month)}/month")


def baked(result: BakeResult) -> None:
    click.echo(f"Baked {_image_line(result.image)} in {result.image.region}, in {result.seconds / 60:.1f} min; "
               f"cluster {result.cluster} released.")
    click.echo(f"Storage: {result.price}, while the image exists (`gpuctl cost` counts it).")
    for_which = " on a type without a GPU (CPU-only TensorFlow)" if result.image.tf_variant == "cpu" else ""
    click.echo(f"Next: gpuctl up --tf {result.image.tensorflow}   boots it{for_which}, without the setup step.")


def removed(image: ImageInfo) -> None:
    click.echo(f"Removed {image.id} ({image.name}) and its {len(image.snapshots)} snapshot(s): "
               f"{usd(image.accrued_usd)} of storage while it existed; nothing more from now on.")
