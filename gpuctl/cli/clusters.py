"""Commands about clusters and money: up, down, status, cost, guard show/set, config show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gpuctl.cli.common import (
    CONTEXT,
    Day,
    PositiveFloat,
    after_failure,
    confirm,
    json_option,
    no_cycle_collection,
    progress_sink,
    session,
)


@click.command(context_settings=CONTEXT)
@click.option("--name", help="Cluster name (setting `cluster`, default 'default').")
@click.option("--provider", help="Where to run: aws, ssh or local (setting `provider`, default aws).")
@click.option("--type", "instance_type", help="EC2 instance type, e.g. g5.xlarge (setting `aws.instance_type`).")
@click.option("--spot/--on-demand", "spot", default=None, help="Market (setting `aws.market`, default spot).")
@click.option("--max-price", type=PositiveFloat(), help="Highest spot price in $/h (default: the on-demand price).")
@click.option("--fallback-on-demand", is_flag=True, default=None, help="Launch on-demand if spot fails in every zone.")
@click.option("--region", help="AWS region (setting `aws.region`; default: boto3's).")
@click.option("--profile", help="AWS profile (setting `aws.profile`).")
@click.option("--image", help="AMI id (default: your baked image for --tf, a TF DLAMI of it, else the Base OSS Nvidia GPU AMI + the setup step).")
@click.option("--tf", "tensorflow", metavar="VERSION",
              help="TensorFlow version, e.g. 2.21 (setting `train.tensorflow`; default: the one gpuctl is tested with).")
@click.option("--disk-gb", type=int, help="Encrypted gp3 root volume size (setting `aws.disk_gb`).")
@click.option("--ssh-cidr", help="Who may SSH in (default: this machine's public IP /32).")
@click.option("--max-hours", type=PositiveFloat(), help="Power off this many hours after boot (setting `guards.max_hours`).")
@click.option("--usd-per-hour", type=float, help="Price per hour for local/ssh clusters (reports only).")
@click.option("--nodes", type=click.IntRange(1, 64), help="Machines in the cluster, for multi-node training (setting "
              "`nodes`; aws: one zone, all or none; local: workers on this machine; ssh: one per --host).")
@click.option("--placement", type=click.Choice(["cluster"]), help="aws, several nodes: a cluster placement group.")
@click.option("--host", "hosts", multiple=True, help="ssh provider: user@host[:port]; repeat for more hosts.")
@click.option("--identity", help="ssh provider: private key file (default: ssh-agent and ~/.ssh keys).")
@click.option("--zone", help="aws: the availability zone to launch in (setting `aws.zone`; default: any offering the type).")
@click.option("--volume", metavar="NAME", help="A volume (`gpuctl volume create`) attached to the chief and mounted "
              "at $GPUCTL_VOLUME_DIR (aws: /mnt/gpuctl/NAME, in the volume's zone); `down` leaves it.")
@click.option("--no-wait", is_flag=True, help="Return once the instance runs, without waiting for SSH.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before starting something that costs money.")
@json_option
@click.pass_context
def up(ctx: click.Context, name: str | None, provider: str | None, instance_type: str | None, spot: bool | None,
       max_price: float | None, fallback_on_demand: bool | None, region: str | None, profile: str | None,
       image: str | None, tensorflow: str | None, disk_gb: int | None, ssh_cidr: str | None, max_hours: float | None,
       usd_per_hour: float | None, nodes: int | None, placement: str | None, hosts: tuple[str, ...], identity: str | None,
       zone: str | None, volume: str | None, no_wait: bool, yes: bool, as_json: bool) -> None:
    """Create a cluster and make it the default for later commands (aws: `up` again finds and reuses it)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.model.requests import UpRequest
    from gpuctl.ops import clusters

    req = UpRequest(name=name, provider=provider, instance_type=instance_type,
                    market=None if spot is None else ("spot" if spot else "on-demand"), max_price=max_price,
                    fallback_on_demand=fallback_on_demand, region=region, profile=profile, image=image,
                    tensorflow=tensorflow, disk_gb=disk_gb, ssh_cidr=ssh_cidr, max_hours=max_hours, nodes=nodes,
                    placement=placement, hosts=hosts, identity=identity, usd_per_hour=usd_per_hour,
                    zone=zone, volume=volume, wait_ssh=not no_wait)
    s = session(ctx, **req.flags())
    from gpuctl.ops import budget

    warning = budget.forecast_warning(s)  # only where `gpuctl aws budget set` made one
    if warning is not None:
        click.echo(warning, err=True)
    question = clusters.launch_question(s, usd_per_hour, volume)
    if question is not None:
        confirm(yes, question)
    held: dict[str, Any] = {}  # the cluster's instances as `up` came to hold them, by id
    # A failure from here on (an SSH wait, Ctrl-C) says what still runs and the `down` that ends it.
    after_failure(ctx, lambda: render_commands.still_running(list(held.values())))
    with progress_sink() as progress:
        result = clusters.up(s, req, progress, told=lambda inst: held.__setitem__(inst.id, inst))
    if as_json:
        return render.emit_json(result)
    render_commands.up(result)


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--cluster", help="Only this cluster (by name: its earlier, released namesakes too) and its runs.")
@click.option("--all", "everything", is_flag=True,
              help="Everything: clusters released over a week ago too, and every provider searched (every "
                   "enabled AWS region) for gpuctl's resources, ledger or not.")
@json_option
@click.pass_context
def status(ctx: click.Context, run: str | None, cluster: str | None, everything: bool, as_json: bool) -> None:
    """Clusters and runs: state, epoch k of N, last metrics, elapsed, cost so far (RUN: that run
    and its cluster; a unique prefix or suffix of its id will do). Clusters released over a week
    ago are left out unless --all."""
    from gpuctl.cli import render
    from gpuctl.cli.render import cost as render_cost
    from gpuctl.ops import costs

    no_cycle_collection(ctx)
    if everything and (run is not None or cluster is not None):
        raise click.UsageError("--all searches everything: give no RUN or --cluster with it")
    if everything:
        from gpuctl.cli.render import commands as render_commands

        every = costs.everything(session(ctx))
        if as_json:
            return render.emit_json(every)
        render_cost.status(every)
        from gpuctl.cli.render import console
        from gpuctl.cli.render import volumes as render_volumes

        render_volumes.storage(every.volumes, console())
        from gpuctl.cli.render import snapshots as render_snapshots

        render_snapshots.storage(every.data, console())
        click.echo("\nEvery provider's gpuctl resources, ledger or not:")
        return render_commands.inventory(every)
    s = session(ctx)
    report = costs.status(s, run, cluster)
    if as_json:
        return render.emit_json(report)
    render_cost.status(report)
    from gpuctl.ops import budget

    state = budget.line(s)  # asks AWS only where `gpuctl aws budget set` made one
    if state is not None:
        from gpuctl.cli.render import bill, console, say

        say(console(), bill.budget_line(state))


RECENT_RUNS = 3  # kept equal to render_cost.RECENT_RUNS (a test checks); here for --help without rich


@click.command(context_settings=CONTEXT)
@click.argument("runs", nargs=-1)
@click.option("--all", "show_all", is_flag=True, help=f"Epoch tables for every run (default: the {RECENT_RUNS} newest).")
@click.option("--compare", is_flag=True, help="Put the named RUNS side by side (two or more).")
@click.option("--csv", "as_csv", is_flag=True, help="One CSV row per epoch of every run reported.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG: cumulative $ by epoch and by time.")
@click.option("--cluster", help="Only this cluster (by name: its earlier, released namesakes too) and its runs.")
@click.option("--billed", is_flag=True, help="AWS's bill (Cost Explorer, daily, unblended) beside gpuctl's estimate "
              "of each aws cluster; answers kept in the ledger ($0.01 a request): docs/billing.md.")
@click.option("--since", type=Day(), help="With --billed: from this day (UTC; default 30 days back).")
@click.option("--refresh", is_flag=True, help="With --billed: ask again for the days not settled yet.")
@json_option
@click.pass_context
def cost(ctx: click.Context, runs: tuple[str, ...], show_all: bool, compare: bool, as_csv: bool,
         plot_path: Path | None, cluster: str | None, billed: bool, since: Any, refresh: bool, as_json: bool) -> None:
    """Spend per cluster and per run, one row per epoch, with the projected total.

    Name RUNS to report only those.
    """
    from gpuctl.cli import render
    from gpuctl.cli.render import cost as render_cost
    from gpuctl.ops import costs

    no_cycle_collection(ctx)
    if (since is not None or refresh) and not billed:
        raise click.UsageError("--since and --refresh go with --billed")
    if billed:
        if runs or show_all or compare or as_csv or plot_path is not None or cluster:
            raise click.UsageError("--billed reports every aws cluster: give it no RUNS, --all, --compare, --csv, "
                                   "--plot or --cluster")
        from gpuctl.cli.render import bill
        from gpuctl.ops import billing

        side = billing.billed(session(ctx), since, refresh)
        return render.emit_json(side) if as_json else bill.billed(side)
    if plot_path is not None:
        from gpuctl.cli.render.plot import check_target

        check_target(plot_path)  # before any work: a missing directory or matplotlib fails here
    # The plain table shows the epochs of the RECENT_RUNS newest runs only: no rows for the others.
    table = not (as_json or as_csv or compare or show_all or runs or plot_path is not None)
    s = session(ctx)
    if as_json and plot_path is None:
        # Each run's JSON is written to a spool as soon as its cost is made, its rows then
        # dropped: memory stays flat in the runs (issue 39: 151 MB at 5,000 runs x 20 epochs).
        with render.JsonSpool() as spool:
            report = costs.cost(s, runs, compare=compare, cluster=cluster, each_run=spool.add)
            return render.emit_json(report, spooled={"runs": spool})
    report = costs.cost(s, runs, compare=compare, cluster=cluster,
                        rows_of_last=RECENT_RUNS if table else None)
    if plot_path is not None:
        from gpuctl.cli.render.plot import plot

        drawn = plot(report, plot_path)
        click.echo(f"Wrote {plot_path} ({drawn} run(s)).", err=True)
    if as_json:
        render.emit_json(report)
    elif as_csv:
        render_cost.cost_csv(report)
    elif compare:
        render_cost.compare(report)
    else:
        render_cost.cost(report, detailed=show_all or bool(runs))
        from gpuctl.cli.render import bill
        from gpuctl.ops import billing

        bill.learned(billing.learned(s))  # what the kept bill showed beyond the estimate


@click.command(context_settings=CONTEXT)
@click.argument("name", required=False)
@click.option("--all", "everything", is_flag=True,
              help="Release everything gpuctl finds by its tags in every provider and region, ledger or not.")
@click.option("--any-owner", is_flag=True,
              help="With --all: also what another gpuctl install (a lost home, a colleague) made in the account.")
@click.option("--force", is_flag=True, help="Release the cluster even if its hosts do not answer (their gpuctl "
              "jobs may then run on).")
@click.option("--pull", is_flag=True, help="Pull every run of the cluster first (into --dest), then release; a "
              "failed pull stops the release unless --force.")
@click.option("--dest", type=click.Path(path_type=Path), default=Path("gpuctl-runs"), show_default=True,
              help="With --pull: the local directory to put the runs' directories in.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def down(ctx: click.Context, name: str | None, everything: bool, any_owner: bool, force: bool, pull: bool,
         dest: Path, yes: bool, as_json: bool) -> None:
    """Stop every job and release the cluster (default: the default cluster). Reports are kept."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import release

    if everything and name:
        raise click.UsageError("give a cluster NAME or --all, not both")
    if any_owner and not everything:
        raise click.UsageError("--any-owner goes with --all")
    if pull and everything:
        raise click.UsageError("--pull goes with one cluster, not --all")
    s = session(ctx)
    if everything:
        whose = ", whichever gpuctl install made it" if any_owner else ""
        confirm(yes, f"release everything gpuctl created, in every provider and region{whose} (volumes stay)")
        with progress_sink() as progress:
            result = release.down_all(s, progress, any_owner)
    else:
        target = release.down_target(s, name)
        if target is not None:
            confirm(yes, release.down_question(s, target))
        with progress_sink() as progress:
            result = release.down(s, name, progress, force=force, pull_to=dest if pull else None)
    if as_json:
        return render.emit_json(result)
    render_commands.down(result, everything)
    if everything:  # they hold data: never released by down, named so nobody forgets what they cost
        from gpuctl.cli.render import volumes as render_volumes

        render_volumes.kept(result.kept)


@click.group(context_settings=CONTEXT)
def guard() -> None:
    """The spend guards that run on the instance: show or change them."""


@guard.command("show", context_settings=CONTEXT)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.option("--check", is_flag=True, help="Also let the watchdog's code look once now on every instance and say "
              "what it sees, what it would decide, and whether firing would work (changes nothing).")
@json_option
@click.pass_context
def guard_show(ctx: click.Context, cluster: str | None, check: bool, as_json: bool) -> None:
    """Each guard, its limit, and the time until it fires."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import guards

    report = guards.show(session(ctx), cluster, check=check)
    return render.emit_json(report) if as_json else render_commands.guard(report)


@guard.command("set", context_settings=CONTEXT)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.option("--idle", help="e.g. 30m; 0 = off")
@click.option("--stall", help="e.g. 20m; 0 = off")
@click.option("--on-stall", type=click.Choice(["warn", "fire"]))
@click.option("--budget", type=float, help="dollars of uptime; 0 = off")
@click.option("--max-hours", type=PositiveFloat(), help="hard cap, hours after launch")
@click.option("--down-after-run/--no-down-after-run", default=None)
@click.option("--grace", help="e.g. 2m")
@click.option("--check-interval", help="e.g. 60s")
@click.option("--on-fire", type=click.Choice(["poweroff", "stop-jobs"]))
@json_option
@click.pass_context
def guard_set(ctx: click.Context, /, cluster: str | None, as_json: bool, **values: Any) -> None:
    """Change the limits of a live cluster: gpuctl guard set --idle 30m --max-hours 6 --budget 20

    On every instance of the cluster; a watchdog that stopped is started again (with no flag too).
    """
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import guards

    names = {"budget": "budget_usd"}  # flag -> setting, where they differ
    report = guards.apply(session(ctx, **{f"guards.{names.get(k, k)}": v for k, v in values.items()}), cluster)
    return render.emit_json(report) if as_json else render_commands.guard(report)


@click.group(context_settings=CONTEXT)
def config() -> None:
    """Inspect settings."""


@config.command("show", context_settings=CONTEXT)
@json_option
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Every setting, its value, and where the value came from."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import config as config_ops

    values = config_ops.show(session(ctx))
    return render.emit_json(values) if as_json else render_commands.config_values(values)
