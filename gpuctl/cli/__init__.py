"""The command line: parse with Click, call one use case in gpuctl.ops, render with gpuctl.cli.render.

This module holds the group and the one place that maps errors to `Error:`/`Hint:` lines and exit
codes (`GpuctlGroup.invoke`); the commands are in cli/clusters.py, cli/runs.py, cli/access.py,
cli/plan.py and cli/images.py.
`gpuctl --help` must stay fast: at import time these modules load only click and gpuctl.errors;
pydantic (config, model), rich (cli/render) and the use cases are imported inside the commands.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click

from gpuctl import __version__
from gpuctl.cli import access, aws, clusters, dashboard, data, images, plan, runs, volumes
from gpuctl.cli.common import AFTER_FAILURE, CONTEXT
from gpuctl.errors import ExitCode, GpuctlError

# The reader of our output went away (`gpuctl cost | head -1`): exit as a tool killed by SIGPIPE
# would (128 + 13), so a `set -o pipefail` script learns the command did not finish what it printed.
PIPE_CLOSED = 141


def _silence_closed_pipe() -> None:
    """Point stdout (and stderr, if it is the same pipe) at /dev/null, so the interpreter's last
    flush has nowhere to fail: no "Exception ignored ... BrokenPipeError" line, no exit code 120."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        same = _same_file(sys.stdout, sys.stderr)  # `2>&1 | head`: stderr is the closed pipe too
        for stream in (sys.stdout, sys.stderr) if same else (sys.stdout,):
            os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (AttributeError, ValueError, OSError):  # not a real file (Click's test runner)
        pass


def _pipe_closed() -> NoReturn:
    _silence_closed_pipe()
    raise click.exceptions.Exit(PIPE_CLOSED)


def _same_file(a: Any, b: Any) -> bool:
    try:
        return os.path.sameopenfile(a.fileno(), b.fileno())
    except (AttributeError, ValueError, OSError):
        return False


def _traceback() -> None:
    import traceback  # only on request: 3 ms that `--help` need not pay

    traceback.print_exc()


def _print_error(exc: GpuctlError) -> None:
    # Plain text, not rich markup: messages quote settings like `[aws] region` and must print as is.
    # Without control sequences: a message may quote what an instance said (an untrusted host).
    from gpuctl.model.untrusted import one_line

    click.echo(click.style("Error:", fg="red", bold=True) + " " + one_line(exc.message, 2000), err=True)
    click.echo(click.style("Hint:", bold=True) + " " + one_line(exc.hint, 2000), err=True)


def _after_failure(ctx: click.Context) -> None:
    """What the failed command registered to say last (cli/common.py after_failure)."""
    for lines in ctx.meta.get(AFTER_FAILURE, ()):
        try:
            said = lines()
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - an addition never hides the failure itself
            continue
        for line in said:
            click.echo(line, err=True)


class GpuctlGroup(click.Group):
    """The one place that maps exceptions to messages and exit codes (and `main` for Click's own)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:  # `gpuctl --help | head -1`: Click printed the help while parsing
            _pipe_closed()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return self._invoke_mapped(ctx)
            finally:
                # Buffered output meets a closed pipe here, where it is handled, rather than in
                # the interpreter's exit.
                sys.stdout.flush()
        except BrokenPipeError:  # from the command, or from printing its error: the reader left
            _pipe_closed()

    def _invoke_mapped(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug")) or os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")
        try:
            return super().invoke(ctx)
        except GpuctlError as exc:
            if debug:
                _traceback()
            _print_error(exc)
            _after_failure(ctx)
            ctx.exit(int(exc.exit_code))
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            _after_failure(ctx)
            ctx.exit(int(ExitCode.INTERRUPTED))
        except BrokenPipeError:  # before `Exception`: a closed pipe is the reader's choice, not a bug
            raise
        except Exception as exc:  # a bug: say so in one line, traceback only on request
            if debug:
                _traceback()
            from gpuctl.provision import foreign_error  # loaded already: the command ran

            cloud = foreign_error(exc)
            if cloud is not None:  # e.g. an AWS failure some call site did not translate: still the cloud's
                _print_error(cloud)
                _after_failure(ctx)
                ctx.exit(int(cloud.exit_code))
            from gpuctl.model.untrusted import one_line

            click.echo(f"Error: internal error: {type(exc).__name__}: {one_line(exc, 2000)}", err=True)
            click.echo("Hint: rerun with --debug and report the traceback.", err=True)
            _after_failure(ctx)
            ctx.exit(int(ExitCode.INTERNAL))


@click.group(cls=GpuctlGroup, context_settings=CONTEXT)
@click.option("--debug", is_flag=True, help="Show tracebacks (also GPUCTL_DEBUG=1).")
@click.version_option(__version__, prog_name="gpuctl")
def cli(debug: bool) -> None:
    """Put a TensorFlow training job on a GPU and take it off again, without surprise bills.

    \b
    gpuctl up                      start a cluster (default provider: aws)
    gpuctl train PROJECT -- ARGS   push the project, start training under tmux
    gpuctl logs -f                 follow the run
    gpuctl cost                    what each epoch cost, what the run will cost
    gpuctl down -y                 release everything
    """
    import logging

    if debug or os.environ.get("GPUCTL_DEBUG", "") not in ("", "0"):
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    else:
        # Libraries' own logging (paramiko prints a traceback for a host that never sends its SSH
        # banner) is not gpuctl's output: gpuctl says what failed in one line of its own.
        logging.getLogger().addHandler(logging.NullHandler())


for _command in (clusters.up, clusters.down, clusters.status, clusters.cost, clusters.guard,
                 clusters.config, runs.train, runs.sync, runs.pull, runs.logs, access.exec_,
                 access.ssh_, access.attach, access.ssh_config, access.tensorboard, access.notebook, runs.runs,
                 runs.watch, runs.stop, plan.plan, images.image, volumes.volume, dashboard.dashboard, data.data,
                 aws.aws):
    cli.add_command(_command)


def main() -> None:
    try:
        cli(prog_name="gpuctl")
    except BrokenPipeError:  # Click printing a usage error into a closed pipe, outside `invoke`
        _silence_closed_pipe()
        sys.exit(PIPE_CLOSED)
