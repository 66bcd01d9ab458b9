"""`gpuctl volume`: create, ls, rm. Parses and renders; the use cases are in ops/volumes.py."""

from __future__ import annotations

import click

from gpuctl.cli.common import CONTEXT, confirm, json_option, progress_sink, session

provider_option = click.option("--provider", help="Whose volume: aws, local or ssh (setting `provider`, default aws).")
region_option = click.option("--region", help="AWS region (setting `aws.region`; default: boto3's).")
profile_option = click.option("--profile", help="AWS profile (setting `aws.profile`).")


@click.group(context_settings=CONTEXT)
def volume() -> None:
    """Named volumes that outlive clusters: `up --volume NAME` gives one to a cluster's chief."""


@volume.command("create", context_settings=CONTEXT)
@click.argument("name")
@click.option("--size", "size_gb", type=int, required=True, metavar="GB", help="Size in GB (1-16384).")
@click.option("--zone", help="aws: the availability zone (setting `aws.zone`; default: the one `up` would pick).")
@click.option("--host", "hosts", multiple=True, help="ssh provider: the host it lives on, user@host[:port].")
@provider_option
@region_option
@profile_option
@click.option("-y", "--yes", is_flag=True, help="Do not ask before creating something that costs money.")
@json_option
@click.pass_context
def create(ctx: click.Context, name: str, size_gb: int, zone: str | None, hosts: tuple[str, ...],
           provider: str | None, region: str | None, profile: str | None, yes: bool, as_json: bool) -> None:
    """Create a volume: aws, an encrypted EBS gp3 volume in one zone; local and ssh, a directory on
    the host. It stays until `gpuctl volume rm`."""
    from gpuctl.cli import render
    from gpuctl.cli.render import volumes as render_volumes
    from gpuctl.ops import volumes

    s = session(ctx, **{"provider": provider or ("ssh" if hosts else None), "aws.region": region,
                        "aws.profile": profile, "ssh.hosts": list(hosts) or None})
    asked = volumes.plan(s, name, size_gb, zone)  # every check, before the question
    if asked.monthly_usd:
        confirm(yes, render_volumes.question(asked))
    with progress_sink() as progress:
        result = volumes.create(s, asked, progress)
    return render.emit_json(result) if as_json else render_volumes.created(result)


@volume.command("ls", context_settings=CONTEXT)
@provider_option
@region_option
@profile_option
@json_option
@click.pass_context
def ls(ctx: click.Context, provider: str | None, region: str | None, profile: str | None, as_json: bool) -> None:
    """Your volumes: where, size, $/month, and the cluster each is attached to."""
    from gpuctl.cli import render
    from gpuctl.cli.render import volumes as render_volumes
    from gpuctl.ops import volumes

    result = volumes.ls(session(ctx, **{"provider": provider, "aws.region": region, "aws.profile": profile}))
    return render.emit_json(result) if as_json else render_volumes.listing(result)


@volume.command("rm", context_settings=CONTEXT)
@click.argument("name")
@region_option
@profile_option
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def rm(ctx: click.Context, name: str, region: str | None, profile: str | None, yes: bool, as_json: bool) -> None:
    """Delete a volume and everything on it (refused while a cluster has it: `down` that first)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import volumes as render_volumes
    from gpuctl.ops import volumes

    s = session(ctx, **{"aws.region": region, "aws.profile": profile})
    target = volumes.removable(s, name)  # exists, nothing uses it: before the question
    confirm(yes, f"delete volume {target.name} ({target.id}, {target.size_gb} GB) and everything on it")
    with progress_sink() as progress:
        result = volumes.remove(s, target, progress)
    return render.emit_json(result) if as_json else render_volumes.removed(result)
