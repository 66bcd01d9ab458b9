"""`gpuctl aws ...`: the AWS account around the clusters: `billing setup` (gpuctl's tags as cost
allocation tags) and `budget set / show / rm / lift` (an AWS Budget with actions: the backstop
behind the guards). docs/billing.md says what each does and costs."""

from __future__ import annotations

import click

from gpuctl.cli.common import CONTEXT, json_option, session


@click.group(context_settings=CONTEXT)
def aws() -> None:
    """The AWS account around the clusters: the bill's tags, and a budget as a backstop."""


@aws.group(context_settings=CONTEXT)
def billing() -> None:
    """Make the bill readable per cluster (gpuctl cost --billed)."""


@billing.command("setup", context_settings=CONTEXT)
@json_option
@click.pass_context
def billing_setup(ctx: click.Context, as_json: bool) -> None:
    """Activate gpuctl:cluster, gpuctl:owner and gpuctl:created-by as cost allocation tags, and say
    their state. AWS shows them in the bill only from activation on; a new key can take a day."""
    from gpuctl.cli import render
    from gpuctl.cli.render import bill
    from gpuctl.ops import billing as billing_ops

    result = billing_ops.setup(session(ctx))
    return render.emit_json(result) if as_json else bill.tag_setup(result)
