"""The command line: parse with Click, call a use case in ops, render with rich.

Errors are mapped to `Error:`/`Hint:` lines and exit codes in one place, `GpuctlGroup.invoke`.
Heavy libraries (boto3, paramiko, fabric, tensorflow) are never imported here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel

from gpuctl import __version__
from gpuctl.errors import ConfirmationRequired, ExitCode, GpuctlError, RunFailedError
from gpuctl.types import DownResult


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)

CONTEXT = {"help_option_names": ["-h", "--help"]}
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


# --- rendering ---------------------------------------------------------------------------------


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, CI logs) rich would assume 80 columns and fold run ids; use more.
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 200)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{seconds:.1f}s" if seconds < 10 else f"{sec}s"


def usd(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.4f}" if abs(value) < 10 else f"${value:,.2f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _metrics(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))


def emit_json(data: BaseModel | list[BaseModel]) -> None:
    if isinstance(data, list):
        payload: Any = [d.model_dump(mode="json") for d in data]
    else:
        payload = data.model_dump(mode="json", by_alias=True)
    click.echo(json.dumps(payload, indent=2))


def _table(*columns: str):
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in columns:
        table.add_column(
            col,
            justify="right" if col.startswith(("$", "sec", "ex/s", "epoch", "up", "elapsed")) else "left",
            no_wrap=col not in ("metrics", "last metrics"),
        )
    return table


def _confirm(yes: bool, question: str) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise ConfirmationRequired(f"refusing to {question} without confirmation")
    if not click.confirm(question[0].upper() + question[1:] + "?", default=False):
        raise click.exceptions.Exit(ExitCode.USAGE)


# --- the error mapping: the one place -----------------------------------------------------------


class GpuctlGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug")) or os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")
        try:
            return super().invoke(ctx)
        except GpuctlError as exc:
            if debug:
                traceback.print_exc()
            from rich.markup import escape

            err = _console(stderr=True)
            # Messages quote settings like `[aws] region`: escape them, or rich eats them as markup.
            err.print(f"[bold red]Error:[/bold red] {escape(exc.message)}", markup=True, soft_wrap=True)
            err.print(f"[bold]Hint:[/bold] {escape(exc.hint)}", markup=True, soft_wrap=True)
            ctx.exit(int(exc.exit_code))
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(int(ExitCode.INTERRUPTED))
        except Exception as exc:  # a bug: say so in one line, traceback only on request
            if debug:
                traceback.print_exc()
            click.echo(f"Error: internal error: {type(exc).__name__}: {exc}", err=True)
            click.echo("Hint: rerun with --debug and report the traceback.", err=True)
            ctx.exit(int(ExitCode.INTERNAL))


def _ops(ctx: click.Context, **flags: Any):
    from gpuctl.ops import Gpuctl
    from gpuctl.state import gpuctl_home

    ops = Gpuctl(gpuctl_home(), flags=flags)
    ctx.call_on_close(ops.close)  # SSH connections end with the command
    return ops


@click.group(cls=GpuctlGroup, context_settings=CONTEXT)
@click.option("--debug", is_flag=True, help="Show tracebacks (also GPUCTL_DEBUG=1).")
@click.version_option(__version__, prog_name="gpuctl")
def cli(debug: bool) -> None:
    """Put a TensorFlow training job on a GPU and take it off again, without surprise bills.

    \b
    gpuctl up                      start a cluster (default provider: local)
    gpuctl train PROJECT -- ARGS   push the project, start training under tmux
    gpuctl logs -f                 follow the run
    gpuctl cost                    what each epoch cost, what the run will cost
    gpuctl down -y                 release everything
    """


class PositiveFloat(click.ParamType):
    name = "number"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not f > 0:
            self.fail(f"{value!r} is not a positive number", param, ctx)
        return f


def _progress(line: str) -> None:
    # One line per step on stderr, flushed: the record of a launch even if it is killed.
    click.echo(f"  {line}", err=True)


@cli.command(context_settings=CONTEXT)
@click.option("--name", help="Cluster name (setting `cluster`, default 'default').")
@click.option("--provider", help="Where to run: aws or local (setting `provider`, default aws).")
@click.option("--type", "instance_type", help="EC2 instance type, e.g. g5.xlarge (setting `aws.instance_type`).")
@click.option("--spot/--on-demand", "spot", default=None, help="Market (setting `aws.market`, default spot).")
@click.option("--max-price", type=PositiveFloat(), help="Highest spot price in $/h (default: the on-demand price).")
@click.option("--fallback-on-demand", is_flag=True, default=None, help="Launch on-demand if spot fails in every zone.")
@click.option("--region", help="AWS region (setting `aws.region`; default: boto3's).")
@click.option("--profile", help="AWS profile (setting `aws.profile`).")
@click.option("--image", help="AMI id (default: the newest TensorFlow Deep Learning AMI).")
@click.option("--disk-gb", type=int, help="Encrypted gp3 root volume size (setting `aws.disk_gb`).")
@click.option("--ssh-cidr", help="Who may SSH in (default: this machine's public IP /32).")
@click.option("--max-hours", type=PositiveFloat(), help="Power off this many hours after boot (setting `guards.max_hours`).")
@click.option("--usd-per-hour", type=float, help="Price per hour for local/ssh clusters (reports only).")
@click.option("--host", "hosts", multiple=True, help="ssh provider: user@host[:port]; repeat for more hosts.")
@click.option("--identity", help="ssh provider: private key file (default: ssh-agent and ~/.ssh keys).")
@click.option("--no-wait", is_flag=True, help="Return once the instance runs, without waiting for SSH.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before starting something that costs money.")
@json_option
@click.pass_context
def up(ctx: click.Context, name: str | None, provider: str | None, instance_type: str | None, spot: bool | None,
       max_price: float | None, fallback_on_demand: bool | None, region: str | None, profile: str | None,
       image: str | None, disk_gb: int | None, ssh_cidr: str | None, max_hours: float | None,
       usd_per_hour: float | None, hosts: tuple[str, ...], identity: str | None, no_wait: bool, yes: bool,
       as_json: bool) -> None:
    """Create a cluster (or reuse it) and make it the default for later commands."""
    flags = {
        "cluster": name, "provider": provider, "aws.instance_type": instance_type,
        "aws.market": None if spot is None else ("spot" if spot else "on-demand"), "aws.max_price": max_price,
        "aws.fallback_on_demand": fallback_on_demand, "aws.region": region, "aws.profile": profile,
        "aws.image": image, "aws.disk_gb": disk_gb, "aws.ssh_cidr": ssh_cidr, "guards.max_hours": max_hours,
        "ssh.hosts": list(hosts) or None, "ssh.identity": identity,
    }
    if hosts and provider is None:
        flags["provider"] = "ssh"  # --host only makes sense for the ssh provider
    ops = _ops(ctx, **flags)
    pre = ops.settings().settings
    rate_key = "ssh.usd_per_hour" if pre.provider == "ssh" else "local.usd_per_hour"
    if usd_per_hour is not None:
        ops.flags[rate_key] = usd_per_hour
    s = ops.settings().settings
    if s.provider == "local" and s.local.usd_per_hour > 0:
        _confirm(yes, f"start local cluster {s.cluster!r} billed at {usd(s.local.usd_per_hour)}/h")
    elif s.provider == "aws":
        _confirm(yes, f"launch a {s.aws.instance_type} ({s.aws.market}) for cluster {s.cluster!r}, "
                      f"billed until `gpuctl down` or the {s.guards.max_hours:g} h hard cap")
    result = ops.up(progress=_progress, wait_ssh=not no_wait)
    if as_json:
        return emit_json(result)
    rate = sum(i.usd_per_hour for i in result.instances)
    verb = "was already up; reused" if result.reused else "is up"
    click.echo(
        f"Cluster {result.cluster.name!r} {verb} ({result.cluster.provider}, {len(result.instances)} instance(s), "
        f"{usd(rate)}/h); it is the default for later commands."
    )
    for i in result.instances:
        if i.region:
            click.echo(f"  {i.id}: {i.instance_type} {i.market} in {i.zone}, {i.public_ip or 'no public IP'}, "
                       f"{usd(i.usd_per_hour)}/h ({i.price_source})")
            click.echo(f"  image {i.image_name or '?'} ({i.image_id}); powers itself off {s.guards.max_hours:g} h after boot")
    click.echo("Next: gpuctl train PROJECT   (e.g. gpuctl train examples/cifar10 -- --data digits --epochs 2)")


@cli.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--cluster", help="Cluster to train on (default: the default cluster).")
@click.option("--data", type=click.Path(path_type=Path), help="Data directory, pushed apart from the code ($GPUCTL_DATA_DIR).")
@click.option("--entry", help="Script to run, relative to PATH (setting `train.entry`).")
@click.option("--budget", type=float, help="Stop the run once its epochs cost this many dollars (setting `guards.budget_usd`).")
@click.option("--allow-cpu", is_flag=True, help="Start even where TensorFlow sees no GPU.")
@click.option("--down/--no-down", "down_after", default=None,
              help="Shut down a grace period after the run ends, success or failure (setting `guards.down_after_run`).")
@click.option("--wait", is_flag=True, help="Follow the log and exit with the run's status.")
@json_option
@click.pass_context
def train(ctx: click.Context, path: Path, args: tuple[str, ...], cluster: str | None, data: Path | None,
          entry: str | None, budget: float | None, allow_cpu: bool, down_after: bool | None, wait: bool,
          as_json: bool) -> None:
    """Push PATH to the cluster and start training under tmux. Put script ARGS after `--`."""
    ops = _ops(ctx, **{"train.entry": entry, "guards.budget_usd": budget})
    result = ops.train(path, cluster=cluster, args=args, data=data, allow_cpu=allow_cpu, progress=_progress,
                       down_after_run=down_after)
    run = result.run
    if as_json and not wait:
        return emit_json(result)
    for label, st in (("code", result.code_sync), ("data", result.data_sync)):
        if st is not None:
            click.echo(f"Pushed {label}: {st.files_copied} of {st.files_total} files, {st.bytes_copied:,} bytes "
                       f"sent in {st.seconds:.2f}s.", err=wait)
    click.echo(f"Run {run.run_id} started on {run.cluster} ({result.host}, tmux session {result.session}).", err=wait)
    if not wait:
        click.echo(f"Follow it: gpuctl logs -f {run.run_id}")
        return
    for chunk in ops.logs(run.run_id, follow=True):
        click.echo(chunk, nl=False)
    final = ops.wait(run.run_id)
    if final.state != "succeeded":
        # The log was just streamed above, so its tail is not repeated here.
        raise RunFailedError(
            f"run {final.run_id} {final.state} (exit code {final.exit_code})",
            f"See the whole log: gpuctl logs {final.run_id}; the run stays listed in `gpuctl status`.",
        )
    click.echo(f"Run {final.run_id} succeeded. Cost report: gpuctl cost", err=True)


@cli.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--cluster", help="Cluster to push to (default: the default cluster).")
@click.option("--data", type=click.Path(path_type=Path), help="Also push this data directory.")
@json_option
@click.pass_context
def sync(ctx: click.Context, path: Path, cluster: str | None, data: Path | None, as_json: bool) -> None:
    """Push PATH (and --data) to the cluster without starting anything."""
    result = _ops(ctx).sync(path, cluster=cluster, data=data)
    if as_json:
        return emit_json(result)
    for label, st, where in (("code", result.code, result.code_dir), ("data", result.data, result.data_dir)):
        if st is not None:
            click.echo(f"{label}: {st.files_copied} of {st.files_total} files, {st.bytes_copied:,} bytes sent, "
                       f"{st.files_deleted} deleted, {st.seconds:.2f}s -> {where}")


@cli.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--dest", type=click.Path(path_type=Path), default=Path("gpuctl-runs"), show_default=True,
              help="Local directory to put the run's directory in.")
@click.pass_context
def pull(ctx: click.Context, run: str | None, dest: Path) -> None:
    """Bring a run's outputs (checkpoints, models, logs, reports) back from the instance."""
    result = _ops(ctx).pull(run, dest)
    click.echo(f"Pulled {result.files} file(s) of {result.run_id} into {result.dest}")


@cli.command("exec", context_settings=CONTEXT)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@json_option
@click.pass_context
def exec_(ctx: click.Context, command: tuple[str, ...], cluster: str | None, as_json: bool) -> None:
    """Run a command on every host of the cluster, in parallel: gpuctl exec -- nvidia-smi"""
    results = _ops(ctx).exec(command, cluster=cluster)
    if as_json:
        return emit_json(results)
    for r in results:
        prefix = f"[{r.host}] " if len(results) > 1 else ""
        for line in r.stdout.splitlines():
            click.echo(prefix + line)
        for line in r.stderr.splitlines():
            click.echo(prefix + line, err=True)
    worst = max((r.returncode for r in results), default=0)
    if worst:
        ctx.exit(worst)


@cli.command("ssh", context_settings=CONTEXT)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.pass_context
def ssh_(ctx: click.Context, command: tuple[str, ...], cluster: str | None) -> None:
    """A shell on the cluster's first host (or run COMMAND there), with gpuctl's key and host key checks."""
    import subprocess

    argv, cwd = _ops(ctx).shell_argv(cluster, list(command) or None)
    ctx.exit(subprocess.call(argv, cwd=cwd))


@cli.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--print", "print_only", is_flag=True, help="Print the command instead of running it.")
@click.pass_context
def attach(ctx: click.Context, run: str | None, print_only: bool) -> None:
    """Attach to a run's live tmux session (detach with Ctrl-b d; the run keeps going)."""
    import shlex
    import subprocess

    argv, cwd = _ops(ctx).attach_argv(run)
    if print_only:
        click.echo(shlex.join(argv))
        return
    ctx.exit(subprocess.call(argv, cwd=cwd))


@cli.command("ssh-config", context_settings=CONTEXT)
@click.option("--install", is_flag=True, help="Also add an Include line for it to ~/.ssh/config.")
@click.pass_context
def ssh_config(ctx: click.Context, install: bool) -> None:
    """Write an ssh config for the live clusters, so plain `ssh CLUSTER` works."""
    result = _ops(ctx).ssh_config(install=install)
    click.echo(f"Wrote {result.path} ({', '.join(result.hosts) or 'no hosts'}).")
    if result.included_from:
        click.echo(f"Included from {result.included_from}: `ssh {result.hosts[0] if result.hosts else 'CLUSTER'}` works.")
    elif not install:
        click.echo(f"Add `Include {result.path}` at the top of ~/.ssh/config, or rerun with --install.")


@cli.command(context_settings=CONTEXT)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.option("--port", type=int, default=6006, show_default=True, help="Local port to open TensorBoard on.")
@click.pass_context
def tensorboard(ctx: click.Context, cluster: str | None, port: int) -> None:
    """Start TensorBoard on the instance over the runs' logs and forward it to localhost (Ctrl-C ends it)."""
    import subprocess

    argv, url = _ops(ctx).tensorboard(cluster, port)
    click.echo(f"TensorBoard: {url}   (nothing is opened to the internet; Ctrl-C to stop forwarding)")
    try:
        ctx.exit(subprocess.call(argv) if argv else 0)
    except KeyboardInterrupt:
        ctx.exit(0)


@cli.command(context_settings=CONTEXT)
@click.option("--all", "everything", is_flag=True,
              help="Search every provider (every enabled AWS region) for gpuctl's resources, ledger or not.")
@json_option
@click.pass_context
def status(ctx: click.Context, everything: bool, as_json: bool) -> None:
    """Clusters and runs: state, epoch k of N, last metrics, elapsed, cost so far."""
    if everything:
        inv = _ops(ctx).inventory()
        if as_json:
            return emit_json(inv)
        t = _table("provider", "kind", "id", "region", "cluster", "state", "in ledger")
        for r in inv.resources:
            t.add_row(r.provider, r.kind, r.id, r.region or "-", r.cluster or "-", r.state or "-",
                      "yes" if r.cluster in inv.ledger_clusters else "NO")
        _console().print(t if inv.resources else "Nothing of gpuctl's is running anywhere it looked.")
        for note in inv.notes:
            click.echo(note, err=True)
        return
    report = _ops(ctx).status()
    if as_json:
        return emit_json(report)
    out = _console()
    if not report.clusters:
        click.echo("No clusters. Start one with: gpuctl up")
        return
    t = _table("cluster", "provider", "state", "uptime", "$/h", "$ so far")
    for c in report.clusters:
        t.add_row(c.name + (" *" if c.is_default else ""), c.provider, c.state, duration(c.uptime_s), usd(c.usd_per_hour), usd(c.usd))
    out.print(t)
    now = time.time()
    for c in report.clusters:
        g = c.guard or {}
        if g.get("error"):
            out.print(f"  {c.name}: watchdog not reachable: {escape(g['error'])}")
        elif g.get("fired"):
            f = g["fired"]
            out.print(f"  {c.name}: guard FIRED: {f['reason']} at {time.strftime('%H:%M:%S', time.localtime(f['at']))}"
                      f" ({escape(f['detail'])}) -> {f['action']}")
        elif g.get("fires_at"):
            soon = ", ".join(f"{k} in {duration(v - now)}" for k, v in sorted(g["fires_at"].items(), key=lambda kv: kv[1] or 0) if v)
            out.print(f"  {c.name}: guards: {soon or 'none counting'}" + (f"; stalled: {', '.join(g['stalled'])}" if g.get("stalled") else ""))
    if report.runs:
        out.print()
        t = _table("run", "cluster", "state", "epoch", "elapsed", "$ so far", "last metrics")
        for r in report.runs:
            state = r.state + (f" ({r.exit_code})" if r.state == "failed" else "")
            epoch = f"{r.epoch}/{r.epochs_planned or '?'}"
            t.add_row(r.run_id, r.cluster, state, epoch, duration(r.elapsed_s), usd(r.usd), _metrics(r.metrics))
        out.print(t)
        for r in report.runs:
            if r.log_tail:
                out.print(f"\n[bold]{r.run_id}[/bold] {r.state}; last lines of its log:")
                out.out(r.log_tail)


@cli.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends.")
@click.option("--guard", "guard_log", is_flag=True, help="The watchdog's decisions instead (of --cluster).")
@click.option("--cluster", help="With --guard: the cluster (default: the default cluster).")
@click.pass_context
def logs(ctx: click.Context, run: str | None, follow: bool, guard_log: bool, cluster: str | None) -> None:
    """Print a run's output (default: the latest run)."""
    if guard_log:
        click.echo(_ops(ctx).guard_log(cluster), nl=False)
        return
    for chunk in _ops(ctx).logs(run, follow=follow):
        click.echo(chunk, nl=False)


RECENT_RUNS = 3


@cli.command(context_settings=CONTEXT)
@click.argument("runs", nargs=-1)
@click.option("--all", "show_all", is_flag=True, help=f"Epoch tables for every run (default: the {RECENT_RUNS} newest).")
@click.option("--compare", is_flag=True, help="Put the named RUNS side by side (two or more).")
@click.option("--csv", "as_csv", is_flag=True, help="One CSV row per epoch of every run reported.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG: cumulative $ by epoch and by time.")
@json_option
@click.pass_context
def cost(ctx: click.Context, runs: tuple[str, ...], show_all: bool, compare: bool, as_csv: bool,
         plot_path: Path | None, as_json: bool) -> None:
    """Spend per cluster and per run, one row per epoch, with the projected total.

    Name RUNS to report only those.
    """
    ops = _ops(ctx)
    if plot_path is not None:
        from gpuctl.plot import check_target

        check_target(plot_path)  # before any work: a missing directory or matplotlib fails here
    report = ops.compare(runs) if compare else ops.cost(runs)
    if plot_path is not None:
        from gpuctl.plot import plot

        drawn = plot(report, plot_path)
        click.echo(f"Wrote {plot_path} ({drawn} run(s)).", err=True)
    if as_json:
        return emit_json(report)
    if as_csv:
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(["run_id", "cluster", "instance_type", "market", "epoch", "seconds", "examples",
                         "examples_per_s", "epoch_cost_usd", "cumulative_usd"])
        for r in report.runs:
            for e in r.epochs:
                writer.writerow([r.run_id, r.cluster, r.instance_type or "", r.market or "", e.epoch, f"{e.seconds:.3f}",
                                 e.examples if e.examples is not None else "",
                                 f"{e.examples_per_s:.3f}" if e.examples_per_s else "",
                                 f"{e.epoch_cost_usd:.6f}", f"{e.cumulative_usd:.6f}"])
        return
    out = _console()
    if compare:
        t = _table("", *[r.run_id for r in report.runs])
        for label, get in (
            ("instance type", lambda r: r.instance_type or "-"), ("market", lambda r: r.market or "-"),
            ("$/h", lambda r: usd(r.usd_per_hour)), ("epochs", lambda r: f"{r.epochs_done}/{r.epochs_planned or '?'}"),
            ("epoch time", lambda r: duration(r.mean_epoch_s)), ("$/epoch", lambda r: usd(r.mean_epoch_usd)),
            ("examples/s", lambda r: _num(r.examples_per_s)), ("$/M examples", lambda r: usd(r.usd_per_million_examples)),
            ("projected total", lambda r: usd(r.projected_total_usd)),
        ):
            t.add_row(label, *[get(r) for r in report.runs])
        out.print(t)
        return
    t = _table("cluster", "provider", "state", "uptime", "$/h", "$ compute", "$ storage", "$", "$ idle", "$ spot saved")
    for c in report.clusters:
        t.add_row(c.name, c.provider, c.state, duration(c.uptime_s), usd(c.usd_per_hour), usd(c.compute_usd),
                  usd(c.storage_usd), usd(c.usd), usd(c.idle_usd), usd(c.spot_savings_usd))
    out.print(t)
    if not report.runs:
        return
    out.print()
    t = _table("run", "cluster", "state", "epochs", "mean epoch", "ex/s", "$/M ex", "$ spent", "$ projected", "finish")
    for r in report.runs:
        finish = time.strftime("%H:%M", time.localtime(r.projected_finish_at)) if r.projected_finish_at else "-"
        t.add_row(r.run_id, r.cluster, r.state, f"{r.epochs_done}/{r.epochs_planned or '?'}",
                  duration(r.mean_epoch_s), _num(r.examples_per_s), usd(r.usd_per_million_examples),
                  usd(r.spent_usd), usd(r.projected_total_usd), finish)
    out.print(t)
    detailed = report.runs if (show_all or runs) else report.runs[-RECENT_RUNS:]
    for r in detailed:
        out.print()
        out.print(f"[bold]{r.run_id}[/bold] on {r.cluster}: {r.state}, {r.epochs_done}/{r.epochs_planned or '?'} epochs at {usd(r.usd_per_hour)}/h")
        if not r.epochs:
            out.print("  no epoch reported yet")
            continue
        t = _table("epoch", "seconds", "examples", "ex/s", "$ epoch", "$ cumulative", "metrics")
        for e in r.epochs:
            t.add_row(str(e.epoch), f"{e.seconds:.2f}", _num(e.examples, "{:,}"), _num(e.examples_per_s),
                      usd(e.epoch_cost_usd), usd(e.cumulative_usd), _metrics(e.metrics))
        out.print(t)
        out.print(
            f"  mean epoch {duration(r.mean_epoch_s)} / {usd(r.mean_epoch_usd)}; spent {usd(r.spent_usd)}; "
            f"projected total {usd(r.projected_total_usd)} ({usd(r.projected_remaining_usd)} still to run)"
        )
    if len(detailed) < len(report.runs):
        out.print(f"\n(epoch tables of {len(report.runs) - len(detailed)} older runs hidden: gpuctl cost --all, or name runs)")
    out.print()
    out.print(f"Total across clusters: {usd(report.total_usd)}")


@cli.command(context_settings=CONTEXT)
@click.argument("name", required=False)
@click.option("--all", "everything", is_flag=True,
              help="Release everything gpuctl finds by its tags in every provider and region, ledger or not.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def down(ctx: click.Context, name: str | None, everything: bool, yes: bool, as_json: bool) -> None:
    """Stop every job and release the cluster (default: the default cluster). Reports are kept."""
    ops = _ops(ctx)
    if everything:
        if name:
            raise click.UsageError("give a cluster NAME or --all, not both")
        _confirm(yes, "release everything gpuctl created, in every provider and region")
        result = ops.down_all(progress=_progress)
    elif name is None and not ops.ledger.clusters(include_down=False):
        result = DownResult(cluster="", already_down=True)
    else:
        target = name or ops.resolve_cluster(None).name
        if ops.ledger.live_cluster(target) is not None:
            _confirm(yes, f"release cluster {target!r} and stop its jobs")
        result = ops.down(target, progress=_progress)
    if as_json:
        return emit_json(result)
    if result.already_down:
        what = f"Cluster {result.cluster!r} is already down" if result.cluster else "No cluster is up"
        click.echo(f"{what}; nothing to do.")
        return
    click.echo(
        f"{'Everything' if everything else 'Cluster ' + repr(result.cluster)} is down: released "
        f"{len(result.released)} resource(s), {len(result.released_instances)} of them instances or work dirs; "
        f"stopped {len(result.stopped_runs)} run(s). Reports stay: gpuctl cost"
    )


@cli.group(context_settings=CONTEXT)
def guard() -> None:
    """The spend guards that run on the instance: show or change them."""


def _render_guard(report: Any) -> None:
    cfg, st = report.config, report.state
    now = time.time()
    click.echo(f"Cluster {report.cluster!r}: on fire -> {cfg.get('on_fire', '?')}"
               f" ({cfg.get('poweroff_command') if cfg.get('on_fire') == 'poweroff' else 'gpuctl jobs only'})")
    rows = [
        ("idle", cfg.get("idle_s"), "no job, idle GPU, no SSH session"),
        ("stall", cfg.get("stall_s"), f"job hung -> {cfg.get('on_stall', 'warn')}"),
        ("budget", cfg.get("budget_usd"), f"${st.get('spent_usd', 0):.4f} spent so far"),
        ("run-done", cfg.get("grace_s") if cfg.get("down_after_run") else 0, "after the run (train --down)"),
        ("hard-cap", cfg.get("hard_cap_at"), "max_hours after launch"),
    ]
    for name, limit, what in rows:
        if not limit:
            click.echo(f"  {name:<9} off")
            continue
        at = (st.get("fires_at") or {}).get(name)
        when = f"fires in {duration(at - now)}" if at and at > now else ("due" if at else "not counting")
        shown = usd(limit) if name == "budget" else (time.strftime('%H:%M', time.localtime(limit)) if name == "hard-cap"
                                                       else duration(limit))
        click.echo(f"  {name:<9} {shown:<10} {when:<22} {what}")
    fired = st.get("fired")
    if fired:
        click.echo(f"  FIRED: {fired['reason']} at {time.strftime('%H:%M:%S', time.localtime(fired['at']))}: "
                   f"{fired['detail']} -> {fired['action']}")


@guard.command("show", context_settings=CONTEXT)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@json_option
@click.pass_context
def guard_show(ctx: click.Context, cluster: str | None, as_json: bool) -> None:
    """Each guard, its limit, and the time until it fires."""
    report = _ops(ctx).guard_show(cluster)
    if as_json:
        return emit_json(report)
    _render_guard(report)


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
def guard_set(ctx: click.Context, cluster: str | None, as_json: bool, **values: Any) -> None:
    """Change the limits of a live cluster: gpuctl guard set --idle 30m --max-hours 6 --budget 20"""
    names = {"budget": "budget_usd"}  # flag -> setting, where they differ
    flags = {f"guards.{names.get(k, k)}": v for k, v in values.items()}
    report = _ops(ctx, **flags).guard_set(cluster)
    if as_json:
        return emit_json(report)
    _render_guard(report)


@cli.group(context_settings=CONTEXT)
def config() -> None:
    """Inspect settings."""


@config.command("show", context_settings=CONTEXT)
@json_option
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Every setting, its value, and where the value came from."""
    values = _ops(ctx).config()
    if as_json:
        return emit_json(values)
    t = _table("setting", "value", "source")
    for v in values:
        t.add_row(v.key, json.dumps(v.value), v.source)
    _console().print(t)


def main() -> None:
    cli(prog_name="gpuctl")
