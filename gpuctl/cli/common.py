"""What the command modules share: option helpers, the session, confirmation, the progress sink,
and running an interactive child (ssh, tmux, a shell). Imports only click at module level."""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import click

from gpuctl.errors import ConfirmationRequired, ExitCode, RemoteError

if TYPE_CHECKING:
    import datetime as dt

    from gpuctl.cli.render import Progress
    from gpuctl.model.results import DownQuestion, LaunchQuestion
    from gpuctl.ops.session import Session

CONTEXT = {"help_option_names": ["-h", "--help"]}
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def no_cycle_collection(ctx: click.Context) -> None:
    """For the rest of a report (status, cost): no cyclic garbage collection. A report builds
    tens of thousands of objects (a model per epoch, its dict, its floats) that hold no cycles and
    live until it is printed; the collector, run after every 700 allocations, walks them again and
    again and frees nothing (a tenth of `cost` at 1,000 runs x 20 epochs). Reference counting still
    frees everything else as it goes; collection comes back when the command ends."""
    import gc

    if gc.isenabled():
        gc.disable()
        ctx.call_on_close(gc.enable)


def session(ctx: click.Context, **flags: Any) -> Session:
    """The use cases' Session for this command, closed (SSH connections end) with the command."""
    from gpuctl.model.untrusted import one_line
    from gpuctl.ops.session import open_session

    s = open_session(flags)
    s.on_wait = lambda line: click.echo(line, err=True)
    s.on_ignored = lambda line: click.echo(one_line(line, 2000), err=True)  # it quotes file names
    ctx.call_on_close(s.close)
    return s


AFTER_FAILURE = "gpuctl.after_failure"  # ctx.meta key: what a failed command adds (cli/__init__.py)


def after_failure(ctx: click.Context, lines: Callable[[], list[str]]) -> None:
    """`lines()` (a list of str) goes to stderr if the command fails or is interrupted, after its
    `Error:`/`Hint:` or `Interrupted.` line: what it leaves running, and how to end it."""
    ctx.meta.setdefault(AFTER_FAILURE, []).append(lines)


def progress_sink() -> Progress:
    """The sink for a use case's progress lines (render.Progress); use it in a `with`."""
    from gpuctl.cli.render import Progress

    return Progress()


def confirm(yes: bool, question: str | DownQuestion | LaunchQuestion) -> None:
    """The one place gpuctl asks before it spends or destroys; "n" (or Ctrl-D, Ctrl-C at the
    question) says so and exits 11 (ExitCode.DECLINED). A question a use case states as a record
    is said by cli/render/questions.py."""
    if yes:
        return
    if not isinstance(question, str):
        from gpuctl.cli.render import questions
        from gpuctl.model.results import LaunchQuestion

        question = questions.launch(question) if isinstance(question, LaunchQuestion) else questions.down(question)
    if not sys.stdin.isatty():
        raise ConfirmationRequired(f"refusing to {question} without confirmation")
    try:
        agreed = click.confirm(question[0].upper() + question[1:] + "?", default=False)
    except click.Abort:  # click's answer to Ctrl-D and Ctrl-C at a prompt: nothing was done either
        click.echo()
        agreed = False
    if not agreed:
        click.echo("Nothing done.")
        raise click.exceptions.Exit(ExitCode.DECLINED)


def run_child(argv: list[str], cwd: str | None = None, *, ready: Callable[[], None] | None = None,
              port: int | None = None, interrupted: int = 130) -> int:
    """Run ssh/tmux/a shell (or an `ssh -N -L` forward) in the foreground; its exit status, as a
    shell would report it. The child never outlives gpuctl: a SIGTERM or SIGHUP for gpuctl is
    passed on, and a Ctrl-C that reached gpuctl alone (a `kill -INT`, not the terminal's, which
    reaches both) ends it too, returning `interrupted`. With `port`, `ready()` is called once
    that local port answers (a forward's browser opened then)."""
    import signal
    import subprocess

    try:
        child = subprocess.Popen(argv, cwd=cwd)
    except OSError as exc:  # gpuctl's own failure, so gpuctl's code (7), never a child's 126/127
        raise RemoteError(f"cannot run {argv[0]}: {exc.strerror or exc}",
                          f"Install {os.path.basename(argv[0])} or put it on PATH.") from exc
    if ready is not None and port is not None:
        import threading

        threading.Thread(target=_when_up, args=(port, ready), daemon=True).start()
    # An `ssh -N -L` left behind would hold the port (and the connection) with nobody to end it.
    forward = {sig: signal.signal(sig, lambda signum, _: child.send_signal(signum))
               for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code = child.wait()
    except KeyboardInterrupt:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        return interrupted
    finally:
        for sig, old in forward.items():
            signal.signal(sig, old)
    return 128 - code if code < 0 else code  # killed by signal N: 128+N, as shells say


def _when_up(port: int, ready: Callable[[], None], timeout_s: float = 30.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                ready()
                return
        except OSError:
            time.sleep(0.2)


class PositiveFloat(click.ParamType[float]):
    """A finite number above 0 (`inf` would be no --max-hours cap at all, a budget of "$inf"), and
    at least `least` where a smaller one means nothing (a budget under a cent is $0.00)."""

    name = "number"

    def __init__(self, least: float | None = None):
        self.least = least

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(f):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if not f > 0:
            self.fail(f"{value!r} is not a positive number", param, ctx)
        if self.least is not None and f < self.least:
            self.fail(f"{value!r} is under {self.least:g}", param, ctx)
        return f


class ScriptArgsCommand(click.Command):
    """`train PROJECT --epochs 3`: Click knows no --epochs; say that script arguments go after `--`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # Click consumes `args` while it parses
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            import shlex

            where = given.index(exc.option_name) if exc.option_name in given else len(given)
            ours, theirs = given[:where], given[where:]
            raise click.UsageError(
                f"no such option: {exc.option_name}\nHint: script arguments go after --: "
                f"gpuctl {ctx.info_name} {shlex.join([*ours, '--', *theirs])}", ctx) from None


class Day(click.ParamType["dt.date"]):
    """A UTC date, YYYY-MM-DD, not in the future and within Cost Explorer's reach."""

    name = "YYYY-MM-DD"

    def convert(self, value: Any, param: Any, ctx: Any) -> dt.date:
        import datetime as dt

        if isinstance(value, dt.date):
            return value
        try:
            day = dt.date.fromisoformat(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a date like 2026-11-30", param, ctx)
        today = dt.datetime.now(dt.timezone.utc).date()
        if day > today:
            self.fail(f"{value} is in the future (today is {today}, UTC)", param, ctx)
        if (today - day).days > 395:
            self.fail(f"{value} is more than 13 months ago: Cost Explorer's daily data does not reach it", param, ctx)
        return day
