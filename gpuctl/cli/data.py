"""`gpuctl data`: push, ls, rm (data snapshots in your gpuctl bucket). Parses and renders; the use
cases are in ops/snapshots.py."""

from __future__ import annotations

from pathlib import Path

import click

from gpuctl.cli.common import CONTEXT, confirm, json_option, progress_sink, session

region_option = click.option("--region", help="AWS region of the bucket (setting `aws.region`; default: boto3's).")
profile_option = click.option("--profile", help="AWS profile (setting `aws.profile`).")


@click.group(context_settings=CONTEXT)
def data() -> None:
    """Data sets uploaded once to your gpuctl bucket in S3; `train --data gpuctl:NAME` fetches one
    on every node, in its region."""


@data.command("push", context_settings=CONTEXT)
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--name", help="The data set's name (default: DIR's name), 1-40 lowercase letters, digits or '-'.")
@region_option
@profile_option
@json_option
@click.pass_context
def push(ctx: click.Context, directory: Path, name: str | None, region: str | None, profile: str | None,
         as_json: bool) -> None:
    """Upload DIR as the data set NAME (new and changed files only; files gone from DIR go from it too)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import snapshots as render_snapshots
    from gpuctl.ops import snapshots

    s = session(ctx, **{"aws.region": region, "aws.profile": profile})
    snapshots.check_push(directory, name)  # every input, before AWS is asked anything
    with progress_sink() as progress:
        result = snapshots.push(s, directory, name, progress)
    return render.emit_json(result) if as_json else render_snapshots.pushed(result)


@data.command("ls", context_settings=CONTEXT)
@json_option
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """Your data sets: files, size, $/month, when each was last trained from."""
    from gpuctl.cli import render
    from gpuctl.cli.render import snapshots as render_snapshots
    from gpuctl.ops import snapshots

    result = snapshots.ls(session(ctx))
    return render.emit_json(result) if as_json else render_snapshots.listing(result)


@data.command("rm", context_settings=CONTEXT)
@click.argument("name")
@region_option
@profile_option
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def rm(ctx: click.Context, name: str, region: str | None, profile: str | None, yes: bool, as_json: bool) -> None:
    """Delete a data set from the bucket (refused while a run on a live cluster uses it)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import snapshots as render_snapshots
    from gpuctl.ops import snapshots

    s = session(ctx, **{"aws.region": region, "aws.profile": profile})
    target = snapshots.removable(s, name)  # exists, nothing uses it: before the question
    confirm(yes, f"delete data set {target.name} ({target.files:,} files, s3://{target.bucket}/{target.prefix})")
    result = snapshots.remove(s, target)
    return render.emit_json(result) if as_json else render_snapshots.removed(result)
