"""Commands about runs: train, sync, pull, logs, watch, stop, runs rm. Those that reach a host's
shell (exec, ssh, attach, ssh-config, tensorboard) are cli/access.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import click

from gpuctl.cli.common import CONTEXT, ScriptArgsCommand, json_option, progress_sink, session
from gpuctl.errors import GpuctlError, RunFailedError

if TYPE_CHECKING:  # the ops are imported when a command runs: `--help` stays fast
    from gpuctl.model.records import RunRecord
    from gpuctl.ops.session import Session


@click.command(cls=ScriptArgsCommand, context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path), required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--resume", "resume_run", metavar="RUN",
              help="Start a failed, stopped, lost or preempted run again from its last checkpoint (same id, "
                   "arguments; with --cluster, on another cluster).")
@click.option("--cluster", help="Cluster to train on (default: the default cluster).")
@click.option("--data", metavar="DIR|s3://BUCKET/PREFIX|gpuctl:NAME", help="Data directory, pushed apart from the code; "
              "or a data set in S3 that each node fetches itself and keeps (gpuctl:NAME: one `gpuctl data push` "
              "uploaded; docs/data.md). The script finds it at $GPUCTL_DATA_DIR.")
@click.option("--entry", help="Script to run, relative to PATH (setting `train.entry`).")
@click.option("--budget", type=float, help="Stop this run once its own epochs cost this many dollars (setting "
              "`train.budget_usd`; the cluster's uptime budget is `guard set --budget`).")
@click.option("--allow-cpu", is_flag=True, help="Start even where TensorFlow sees no GPU.")
@click.option("--recheck", is_flag=True, help="Check the host's TensorFlow and GPUs afresh, not the answer kept "
              "from an earlier train in the same environment.")
@click.option("--env", "env_names", multiple=True, metavar="NAME",
              help="Pass this environment variable from here to the job (repeatable). Its value is never "
                   "recorded; script ARGS are (in the ledger), so pass secrets this way.")
@click.option("--down/--no-down", "down_after", default=None,
              help="Shut down a grace period after the run ends, success or failure (setting `guards.down_after_run`).")
@click.option("--gpus", type=int, metavar="N", help="GPUs of a node the run waits for in the cluster's queue "
              "(default: all of a node; a node without GPU has one slot).")
@click.option("--now", "now", is_flag=True, help="Start at once, beside the runs on the cluster, without queueing.")
@click.option("--wait", is_flag=True, help="Follow the log and exit with the run's status (with --json: the log on "
              "stderr, the ended run as JSON).")
@click.option("--recover/--no-recover", default=None, help="With --wait: when the spot instance is interrupted, "
              "launch a replacement and resume the run there (setting `recover.enabled`; default: on for spot).")
@json_option
@click.pass_context
def train(ctx: click.Context, path: Path | None, args: tuple[str, ...], resume_run: str | None, cluster: str | None,
          data: str | None, entry: str | None, budget: float | None, allow_cpu: bool, recheck: bool,
          env_names: tuple[str, ...], down_after: bool | None, gpus: int | None, now: bool, wait: bool,
          recover: bool | None, as_json: bool) -> None:
    """Push PATH to the cluster and start training under tmux. Put script ARGS after `--`.
    `train --resume RUN` continues a run from its checkpoint instead."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import runs

    if recover is not None and not wait:  # refused before anything starts
        raise click.UsageError("--recover/--no-recover is for --wait (or `gpuctl watch RUN`)")
    s = session(ctx, **{"train.entry": entry, "train.budget_usd": budget})
    if resume_run is not None:
        given = [o for o, v in (("PATH", path), ("ARGS", args), ("--data", data),
                                ("--entry", entry), ("--budget", budget), ("--env", env_names),
                                ("--down/--no-down", down_after is not None), ("--gpus", gpus), ("--now", now),
                                ("--recheck", recheck)) if v]
        if given:
            raise click.UsageError(f"--resume runs the run as it was: {', '.join(given)} cannot change it")
        from gpuctl.ops import resume

        with progress_sink() as progress:
            run = resume.resume(s, resume_run, progress, on=cluster)
        click.echo(f"Run {run.run_id} resumed from its checkpoint on {run.cluster}.", err=wait or as_json)
        result = None
    elif path is None:
        raise click.UsageError("give the project to train (PATH), or --resume RUN")
    else:
        from gpuctl.model.data import is_s3
        from gpuctl.model.requests import TrainRequest
        from gpuctl.model.snapshots import is_snapshot

        s3 = data is not None and (is_s3(data) or is_snapshot(data))
        with progress_sink() as progress:
            result = runs.train(s, TrainRequest(project=path, cluster=cluster, args=args,
                                                data=Path(data) if data is not None and not s3 else None,
                                                data_url=data if s3 else None,
                                                env_names=env_names, gpus=gpus, now=now, allow_cpu=allow_cpu,
                                                recheck=recheck, down_after_run=down_after), progress)
        run = result.run
    if as_json and not wait:
        return render.emit_json(result if result is not None else run)
    if result is not None:
        render_commands.train_started(result, to_stderr=wait)
    if not wait:
        return
    from gpuctl.ops import recovery

    with _detach_on_ctrl_c(ctx, s, run.run_id), progress_sink() as progress:
        for chunk in recovery.follow(s, run.run_id, progress, recover=recover):
            click.echo(chunk, nl=False, err=as_json)  # with --json, stdout holds the JSON alone
        final = runs.wait(s, run.run_id)
    if as_json:
        render.emit_json(result.model_copy(update={"run": final}) if result is not None else final)
    if final.state != "succeeded":
        # The chief's log was just streamed above: its tail is not repeated here.
        raise _ended_badly(s, final, "the run stays listed in `gpuctl status`")
    click.echo(f"Run {final.run_id} succeeded. Cost report: gpuctl cost", err=True)


@click.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--cluster", help="Cluster to push to (default: the default cluster).")
@click.option("--data", help="Also push this data directory (an S3 data set is `train --data`'s to fetch).")
@json_option
@click.pass_context
def sync(ctx: click.Context, path: Path, cluster: str | None, data: str | None, as_json: bool) -> None:
    """Push PATH (and --data) to the cluster without starting anything."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import runs

    runs.refuse_s3(data, "sync")
    with progress_sink() as progress:
        result = runs.sync(session(ctx), path, cluster=cluster, data=Path(data) if data is not None else None,
                           progress=progress)
    if as_json:
        return render.emit_json(result)
    render_commands.synced(result)


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--dest", type=click.Path(path_type=Path), default=Path("gpuctl-runs"), show_default=True,
              help="Local directory to put the run's directory in.")
@json_option
@click.pass_context
def pull(ctx: click.Context, run: str | None, dest: Path, as_json: bool) -> None:
    """Bring a run's outputs (checkpoints, models, logs, reports) back from the instance, or after
    `down` from where they were kept (the S3 checkpoint store on aws). What it leaves out (links
    leading out of the run, FIFOs, devices, odd keys) is listed (`skipped` in --json)."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import runs

    result = runs.pull(session(ctx), run, dest)
    if as_json:
        return render.emit_json(result)
    render_commands.pulled(result)


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends.")
@click.option("--guard", "guard_log", is_flag=True, help="The watchdog's decisions instead (of --cluster).")
@click.option("--setup", "setup_log", is_flag=True,
              help="The setup step's log (pip installing TensorFlow) on each host (of --cluster).")
@click.option("--tf", "tensorflow", metavar="VERSION", help="With --setup: that version's (default: the cluster's).")
@click.option("--cluster", help="With --guard or --setup: the cluster (default: the default cluster).")
@click.option("--raw", is_flag=True, help="Every line, TensorFlow's start-up chatter included.")
@click.option("--plain", is_flag=True, help="Strip terminal control sequences (colours, cursor moves, window "
              "titles) and resolve carriage returns, for a log you do not trust or want as plain text.")
@click.option("--node", type=click.IntRange(0), default=0, show_default=True,
              help="A multi-node run: that node's output (0 is the chief).")
@click.option("--recover/--no-recover", default=None, help="With -f: replace an interrupted spot instance and "
              "resume the run (setting `recover.enabled`; default: on for spot clusters).")
@click.pass_context
def logs(ctx: click.Context, run: str | None, follow: bool, guard_log: bool, setup_log: bool, tensorflow: str | None,
         cluster: str | None, raw: bool, plain: bool, node: int, recover: bool | None) -> None:
    """Print a run's output (default: the latest run).

    The output is the job's own, byte for byte, control sequences included (as `attach` shows
    it): colours and progress bars work, and so would any escape sequence the instance wrote.
    --plain strips them. Every other command shows what came from an instance without them.
    """
    from gpuctl.model.untrusted import clean

    def echo(text: str, nl: bool = True, err: bool = False) -> None:
        click.echo(clean(text) if plain else text, nl=nl, err=err)
    if guard_log and setup_log:
        raise click.UsageError("--guard and --setup are two different logs: pass one")
    if node and (guard_log or setup_log):
        raise click.UsageError("--node is for a run's output: --guard and --setup show every host already")
    if setup_log:
        from gpuctl.ops import setup

        s = session(ctx)
        for host, text in setup.setup_log(s, s.resolve_cluster(cluster), tensorflow):
            echo(f"== {host}", err=True)
            echo(text, nl=False)
        return
    if guard_log:
        from gpuctl.ops import guards

        echo(guards.decisions(session(ctx), cluster), nl=False)
        return
    from gpuctl.ops import recovery, runs

    s = session(ctx)
    if not follow:
        for chunk in runs.logs(s, run, raw=raw, node=node):
            echo(chunk, nl=False)
        return
    run_id = s.find_run(run).run_id
    with _detach_on_ctrl_c(ctx, s, run_id):
        if node:  # another node's output only: following the chief's drives recovery
            for chunk in runs.logs(s, run_id, follow=True, raw=raw, node=node):
                echo(chunk, nl=False)
            return
        with progress_sink() as progress:  # following drives recovery too (recover.enabled)
            for chunk in recovery.follow(s, run_id, progress, recover=recover, raw=raw):
                echo(chunk, nl=False)


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--detach", is_flag=True, help="Keep watching in the background, after this terminal closes "
              "(its decisions go to a log under gpuctl's home).")
@click.pass_context
def watch(ctx: click.Context, run: str | None, detach: bool) -> None:
    """Watch a run (default: the latest) until it ends, and recover it when its spot instance is
    interrupted: a replacement with the cluster's spec, the run resumed from its checkpoint
    (settings `recover.*`). Meant to stay up on an always-on machine."""
    from gpuctl.ops import recovery

    s = session(ctx)
    if detach:
        found, pid, log = recovery.detach(s, run)
        click.echo(f"Watching run {found.run_id} in the background (pid {pid}); its decisions: {log}")
        return
    with _detach_on_ctrl_c(ctx, s, s.find_run(run).run_id), progress_sink() as progress:
        final = recovery.watch(s, run, progress)
    if final.state != "succeeded":
        raise _ended_badly(s, final)


@contextmanager
def _detach_on_ctrl_c(ctx: click.Context, s: Session, run_id: str) -> Iterator[None]:
    """Ctrl-C while following a run only stops following (as `sky logs` does): say that the run
    goes on billing, where, and how to stop it; exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        from gpuctl.cli.render import commands as render_commands
        from gpuctl.errors import ExitCode
        from gpuctl.model.records import FINAL_RUN_STATES

        run = s.ledger.run(run_id)
        if run is None or run.state in FINAL_RUN_STATES:
            raise  # nothing goes on: the plain "Interrupted."
        render_commands.detached(run)
        ctx.exit(int(ExitCode.INTERRUPTED))


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--cluster", help="Without RUN: that cluster's latest running run (default: the default cluster).")
@click.option("--all", "every", is_flag=True, help="Every running run of the cluster.")
@json_option
@click.pass_context
def stop(ctx: click.Context, run: str | None, cluster: str | None, every: bool, as_json: bool) -> None:
    """Stop a run (default: the latest running one) and keep the cluster up: SIGTERM, then SIGKILL
    after a grace period, on every node. The run ends `stopped`; `train --resume RUN` continues it."""
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import stop as stop_ops

    if run and every:
        raise click.UsageError("RUN names one run; --all stops every running run of --cluster: pass one")
    with progress_sink() as progress:
        result = stop_ops.stop(session(ctx), run, cluster=cluster, every=every, progress=progress)
    if as_json:
        return render.emit_json(result)
    render_commands.stopped(result)


def _ended_badly(s: Session, final: RunRecord, more: str = "") -> RunFailedError:
    """The error for a run that did not succeed; a multi-node run's failing node (not the chief)
    shows its last lines first, since only the chief's log was followed."""
    from gpuctl.ops import nodes, runs

    node = final.failed_node
    late = nodes.did_not_start(final)
    if late is not None:  # nothing of its own to show: its job never began there
        return late
    if node:
        try:
            from gpuctl.model.untrusted import clean

            click.echo(clean(f"== last lines of node {node}'s log\n{runs.log_tail(s, final, 20)}"), err=True)
        except GpuctlError:
            pass  # the node does not answer: the error below still names it

    where, flag = (f" on node {node}", f" --node {node}") if node is not None else ("", "")
    return RunFailedError(f"run {final.run_id} {final.state}{where} (exit code {final.exit_code})",
                          f"See the whole log: gpuctl logs {final.run_id}{flag}" + (f"; {more}." if more else "."))


@click.group(context_settings=CONTEXT)
def runs() -> None:
    """Runs' kept files: `gpuctl runs rm RUN` deletes a finished run's checkpoints."""


@runs.command("rm", context_settings=CONTEXT)
@click.argument("run")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def runs_rm(ctx: click.Context, run: str, yes: bool, as_json: bool) -> None:
    """Delete RUN's checkpoints and files for good: from the checkpoint store (aws: the S3 bucket,
    under every cluster holding a copy) and from its cluster's host if that is up. The ledger
    keeps the run's record, so its epochs and dollars stay in `gpuctl cost`. A running run is
    refused."""
    from gpuctl.cli import render
    from gpuctl.cli.common import confirm
    from gpuctl.ops import checkpoints

    s = session(ctx)
    confirm(yes, checkpoints.remove_question(s, run))
    with progress_sink() as progress:
        result = checkpoints.remove(s, run, progress)
    if as_json:
        return render.emit_json(result)
    where = [f"{result.store_files} file(s) from the checkpoint store"] if result.store_files else []
    where += [f"{result.host_dir} on its host"] if result.host_dir else []
    click.echo(f"Run {result.run_id}: deleted {' and '.join(where) or 'nothing (no files were kept)'}."
               + (f" Note: {result.note}." if result.note else ""))
