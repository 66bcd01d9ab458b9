"""`gpuctl aws ...`: the AWS account around the clusters: `billing setup` (gpuctl's tags as cost
allocation tags) and `budget set / show / rm / lift` (an AWS Budget with actions: the backstop
behind the guards). docs/billing.md says what each does and costs."""

from __future__ import annotations

import click

from gpuctl.cli.common import CONTEXT, PositiveFloat, confirm, json_option, session


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


@aws.group(context_settings=CONTEXT)
def budget() -> None:
    """An AWS Budget on gpuctl's resources that stops them and denies launches when passed."""


@budget.command("set", context_settings=CONTEXT)
@click.option("--monthly-usd", type=PositiveFloat(least=0.01), required=True,
              help="The month's limit in dollars (at least 0.01).")
@click.option("--email", help="Who AWS tells at 80 % and 100 % and when the action fires (needed the first time).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before making the budget (action-enabled budgets cost).")
@json_option
@click.pass_context
def budget_set(ctx: click.Context, monthly_usd: float, email: str | None, yes: bool, as_json: bool) -> None:
    """Make or update the budget: when actual spend passes N, AWS stops gpuctl's running instances
    and denies your identity new launches until `gpuctl aws budget lift`."""
    from gpuctl.cli import render
    from gpuctl.cli.render import bill
    from gpuctl.ops import budget as budget_ops

    s = session(ctx)
    budget_ops.check_email(email)
    confirm(yes, f"set an AWS budget of ${monthly_usd:,.2f}/month on gpuctl's resources, with actions "
                 "(AWS charges for action-enabled budgets: docs/billing.md)")
    state = budget_ops.set_budget(s, monthly_usd, email)
    return render.emit_json(state) if as_json else bill.budget(state)


@budget.command("show", context_settings=CONTEXT)
@json_option
@click.pass_context
def budget_show(ctx: click.Context, as_json: bool) -> None:
    """The budget: its limit, spend so far, forecast, and its actions' state."""
    from gpuctl.cli import render
    from gpuctl.cli.render import bill
    from gpuctl.ops import budget as budget_ops

    state = budget_ops.show(session(ctx))
    if as_json:
        return click.echo("null") if state is None else render.emit_json(state)
    bill.budget(state)


@budget.command("rm", context_settings=CONTEXT)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def budget_rm(ctx: click.Context, yes: bool, as_json: bool) -> None:
    """Remove the budget and its actions (what they applied is lifted first)."""
    from gpuctl.cli import render
    from gpuctl.ops import budget as budget_ops

    s = session(ctx)
    confirm(yes, "remove gpuctl's AWS budget and its actions (no backstop above the guards after this)")
    gone = budget_ops.remove(s)
    if as_json:
        return render.emit_json(gone)
    click.echo(f"Budget {gone.name} removed." if gone.removed else "No gpuctl budget to remove.")


@budget.command("lift", context_settings=CONTEXT)
@json_option
@click.pass_context
def budget_lift(ctx: click.Context, as_json: bool) -> None:
    """Take the budget's deny policy off your identity again, so that `up` may launch."""
    from gpuctl.cli import render
    from gpuctl.cli.render import bill
    from gpuctl.ops import budget as budget_ops

    state = budget_ops.lift(session(ctx))
    return render.emit_json(state) if as_json else bill.budget(state)
