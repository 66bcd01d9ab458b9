"""`gpuctl image`: bake, ls, rm. Parses and renders; the use cases are in ops/images.py."""

from __future__ import annotations

from pathlib import Path

import click

from gpuctl.cli.common import CONTEXT, confirm, json_option, progress_sink, session

region_option = click.option("--region", help="AWS region (setting `aws.region`; default: boto3's).")
profile_option = click.option("--profile", help="AWS profile (setting `aws.profile`).")
# Images are the aws provider's: with another provider in the settings, --provider aws says which.
provider_option = click.option("--provider", help="Whose images: aws (setting `provider`, default aws).")


@click.group(context_settings=CONTEXT)
def image() -> None:
    """Machine images with TensorFlow baked in: `up` boots them without the setup step."""


@image.command("ls", context_settings=CONTEXT)
@provider_option
@region_option
@profile_option
@json_option
@click.pass_context
def ls(ctx: click.Context, provider: str | None, region: str | None, profile: str | None, as_json: bool) -> None:
    """Your baked images: id, TensorFlow, base image, created, size and monthly storage cost."""
    from gpuctl.cli import render
    from gpuctl.cli.render import images as render_images
    from gpuctl.ops import images

    result = images.ls(session(ctx, **{"provider": provider, "aws.region": region, "aws.profile": profile}))
    return render.emit_json(result) if as_json else render_images.listing(result)


@image.command("rm", context_settings=CONTEXT)
@click.argument("image_id", metavar="AMI_ID")
@provider_option
@region_option
@profile_option
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def rm(ctx: click.Context, image_id: str, provider: str | None, region: str | None, profile: str | None, yes: bool,
       as_json: bool) -> None:
    """Deregister one of your baked images and delete its snapshots."""
    from gpuctl.cli import render
    from gpuctl.cli.render import images as render_images
    from gpuctl.ops import images

    s = session(ctx, **{"provider": provider, "aws.region": region, "aws.profile": profile})
    confirm(yes, f"deregister image {image_id} and delete its snapshots")
    with progress_sink() as progress:
        result = images.remove(s, image_id, progress)
    return render.emit_json(result) if as_json else render_images.removed(result)


@image.command("bake", context_settings=CONTEXT)
@click.option("--tf", "tensorflow", metavar="VERSION",
              help="TensorFlow version, e.g. 2.21 (setting `train.tensorflow`; default: the one gpuctl is tested with).")
@click.option("--type", "instance_type", help="EC2 instance type to bake on (setting `aws.instance_type`).")
@click.option("--spot/--on-demand", "spot", default=None, help="Market (setting `aws.market`, default spot).")
@provider_option
@region_option
@profile_option
@click.option("--ssh-cidr", help="Who may SSH in (default: this machine's public IP /32).")
@click.option("--allow-cpu", is_flag=True, help="Bake even where TensorFlow sees no GPU (a CPU-only image).")
@click.option("--requirements", type=click.Path(path_type=Path), metavar="FILE",
              help="A project's requirements.txt, installed over the image's TensorFlow: a train with the same "
                   "file then installs nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before starting something that costs money.")
@json_option
@click.pass_context
def bake(ctx: click.Context, tensorflow: str | None, instance_type: str | None, spot: bool | None,
         provider: str | None, region: str | None, profile: str | None, ssh_cidr: str | None, allow_cpu: bool,
         requirements: Path | None, yes: bool, as_json: bool) -> None:
    """Launch from the base GPU image, install TensorFlow, prove it on the GPU, and save the disk as
    an image (then release the instance)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import images as render_images
    from gpuctl.ops import images, packages

    wanted = packages.requirements_file(requirements) if requirements is not None else None  # before any question
    s = session(ctx, **{
        "provider": provider, "train.tensorflow": tensorflow, "aws.instance_type": instance_type,
        "aws.market": None if spot is None else ("spot" if spot else "on-demand"),
        "aws.region": region, "aws.profile": profile, "aws.ssh_cidr": ssh_cidr,
    })
    confirm(yes, images.bake_question(s))
    with progress_sink() as progress:
        result = images.bake(s, progress, allow_cpu=allow_cpu, requirements=wanted)
    return render.emit_json(result) if as_json else render_images.baked(result)
