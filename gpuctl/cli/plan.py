"""`gpuctl plan`: which machine trains this project for the least money, measured on the project."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from gpuctl.cli.common import CONTEXT, ScriptArgsCommand, confirm, json_option, progress_sink, session


@contextmanager
def _term_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a closed terminal, a `kill`) stop the probes as Ctrl-C does, so their
    clusters are released; only SIGKILL leaves them, to `status --all` and `down --all`."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@click.command(cls=ScriptArgsCommand, context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--type", "types", multiple=True, metavar="TYPE",
              help="Probe this instance type on a cluster of its own, launched and released (repeatable).")
@click.option("--cluster", "clusters", multiple=True, metavar="NAME",
              help="Probe on this cluster, which is up (any provider; repeatable); it stays up.")
@click.option("--spot/--on-demand", "spot", default=None, help="Market of the --type probes (setting `aws.market`).")
@click.option("--epochs", type=int, required=True, help="Epochs the whole run will train: what is projected.")
@click.option("--probe-epochs", type=int, default=2, show_default=True,
              help="Epochs each probe trains (the first includes compilation and warm-up, the rest are steady).")
@click.option("--max-usd", type=float, default=2.0, show_default=True,
              help="Refuse a plan whose worst case (each probe's $/h x the hours it may bill) is above this.")
@click.option("--probe-timeout", default="30m", show_default=True,
              help="A probe still running after this (from its run's start) is stopped and shown as such.")
@click.option("--from-history", is_flag=True, help="Rank this project's past runs instead; launches nothing.")
@click.option("--data", help="Data directory, pushed with the project (an S3 data set is `train --data`'s to fetch).")
@click.option("--allow-cpu", is_flag=True, help="Probe even where TensorFlow sees no GPU.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG: projected dollars "
              "against hours, one point per machine.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before launching probe clusters.")
@json_option
@click.pass_context
def plan(ctx: click.Context, path: Path, args: tuple[str, ...], types: tuple[str, ...], clusters: tuple[str, ...],
         spot: bool | None, epochs: int, probe_epochs: int, max_usd: float, probe_timeout: str, from_history: bool,
         data: str | None, allow_cpu: bool, plot_path: Path | None, yes: bool, as_json: bool) -> None:
    """Which machine trains PATH for the least money: run it for a few epochs on each (--type, --cluster),
    project --epochs N from what they measured, rank by dollars. Script ARGS after `--`.

    \b
    gpuctl plan proj --type g4dn.xlarge --type g5.xlarge --type g6.xlarge --epochs 50 -- --lr 3e-4
    gpuctl plan proj --cluster lab --cluster local --epochs 50
    gpuctl plan proj --from-history --epochs 50
    """
    from gpuctl.cli import render
    from gpuctl.cli.render import plan as render_plan
    from gpuctl.errors import ConfigError
    from gpuctl.ops import plan as plan_ops
    from gpuctl.ops.runs import refuse_s3

    refuse_s3(data, "plan")
    if plot_path is not None:
        from gpuctl.cli.render.plot import check_target

        check_target(plot_path)  # before anything is launched
    s = session(ctx)
    chosen = {name for name in ("spot", "probe_epochs", "max_usd", "probe_timeout", "allow_cpu")
              if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    if from_history:
        given = [o for o, v in (("--type", types), ("--cluster", clusters), ("ARGS", args), ("--data", data)) if v]
        given += [f"--{name.replace('_', '-')}" if name != "spot" else "--spot/--on-demand" for name in sorted(chosen)]
        if given:
            raise ConfigError(f"--from-history launches nothing: {', '.join(given)} cannot go with it",
                              "Leave them out, or drop --from-history to measure.")
        report = plan_ops.from_history(s, path, epochs)
    else:
        if "spot" in chosen and not types:
            raise ConfigError("--spot/--on-demand is the market of --type probes, and none is given",
                              "A --cluster probe runs on the cluster as it is; leave the market out.")
        request = plan_ops.PlanRequest(project=path, epochs=epochs, types=types, clusters=clusters, spot=spot,
                                       probe_epochs=probe_epochs, max_usd=max_usd, probe_timeout=probe_timeout,
                                       args=args, data=Path(data) if data is not None else None,
                                       allow_cpu=allow_cpu)
        checked = plan_ops.check(s, request)
        if checked.question is not None:
            confirm(yes, checked.question)
            if yes:  # not asked: the money is said all the same, before anything launches
                click.echo(f"gpuctl: {checked.question[0].upper()}{checked.question[1:]}.", err=True)
        with _term_as_interrupt(), progress_sink() as progress:
            report = plan_ops.run(s, checked, progress)
    # The report first: the probes are paid for, and a plot that cannot be written must not lose it.
    if as_json:
        render.emit_json(report)
    else:
        render_plan.plan(report)
    if plot_path is not None:
        from gpuctl.cli.render.plot import plan_plot

        try:
            click.echo(f"Wrote {plot_path} ({plan_plot(report, plot_path)} machine(s)).", err=True)
        except OSError as exc:
            raise ConfigError(f"cannot write the plot {plot_path}: {exc.strerror or exc}",
                              "The report above stands; pick a writable path for --plot next time.") from None
    plan_ops.raise_for(report)
