"""Commands that reach a cluster's hosts: exec, ssh, attach, ssh-config, tensorboard, notebook.

exec, ssh, attach and tensorboard exit with the child's (the remote command's) status; gpuctl's own
failures in them raise GpuctlError before the child runs, so they keep gpuctl's exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import click

from gpuctl.cli.common import CONTEXT, json_option, run_child, session


@click.command("exec", context_settings=CONTEXT)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@json_option
@click.pass_context
def exec_(ctx: click.Context, command: tuple[str, ...], cluster: str | None, as_json: bool) -> None:
    """Run a command on every host of the cluster, in parallel: gpuctl exec -- nvidia-smi

    \b
    One argument is a shell line, as with ssh: gpuctl exec -- 'ls ~; echo $PATH'
    Several are words, each passed as it is:   gpuctl exec -- ls -l 'a file'

    Exits with the worst exit status of the hosts (also with --json).
    """
    from gpuctl.cli import render
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import runs

    results = runs.exec_command(session(ctx), command, cluster=cluster)
    if as_json:
        render.emit_json(results)
    else:
        render_commands.exec_output(results)
    codes = [128 - r.returncode if r.returncode < 0 else r.returncode for r in results]
    worst = max(codes, default=0)
    if worst:
        ctx.exit(worst)


@click.command("ssh", context_settings=CONTEXT)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.pass_context
def ssh_(ctx: click.Context, command: tuple[str, ...], cluster: str | None) -> None:
    """A shell on the cluster's first host (or run COMMAND there), with gpuctl's key and host key checks.

    Exits with the remote command's status.
    """
    from gpuctl.ops import access

    ctx.exit(access.shell(session(ctx), cluster, list(command) or None, run_child))


@click.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("--print", "print_only", is_flag=True, help="Print the command instead of running it.")
@click.pass_context
def attach(ctx: click.Context, run: str | None, print_only: bool) -> None:
    """Attach to a run's live tmux session (detach with Ctrl-b d; the run keeps going)."""
    import shlex

    from gpuctl.ops import access

    if print_only:
        click.echo(shlex.join(access.attach_command(session(ctx), run)[0]))
        return

    def in_terminal(argv: list[str], cwd: str | None) -> int:
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            from gpuctl.errors import ConfigError

            raise ConfigError("attach needs a terminal (tmux draws the run's screen there)",
                              "Run it in a terminal, follow the output with `gpuctl logs -f`, or print the "
                              "command with `gpuctl attach --print`.")
        return run_child(argv, cwd)

    ctx.exit(access.attach(session(ctx), run, in_terminal))


@click.command("ssh-config", context_settings=CONTEXT)
@click.option("--install", is_flag=True, help="Also add an Include line for it to ~/.ssh/config.")
@click.pass_context
def ssh_config(ctx: click.Context, install: bool) -> None:
    """Write an ssh config for the live clusters, so plain `ssh CLUSTER` works."""
    from gpuctl.cli.render import commands as render_commands
    from gpuctl.ops import access

    render_commands.ssh_config(access.ssh_config(session(ctx), install=install), install)


@click.command(context_settings=CONTEXT)
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.option("--port", type=click.IntRange(1, 65535), default=6006, show_default=True,
              help="Local port to open TensorBoard on.")
@click.pass_context
def tensorboard(ctx: click.Context, cluster: str | None, port: int) -> None:
    """Start TensorBoard on the instance over the runs' logs and forward it to localhost (Ctrl-C ends it).

    It answers you only: open the URL printed (it carries a token, which sets a cookie); anyone
    else, on this machine or on the instance, gets 403.
    """
    from gpuctl.ops import access

    argv, url = access.tensorboard(session(ctx), cluster, port)
    click.echo(f"TensorBoard: {url}   (yours only: the token; nothing is opened to the internet; Ctrl-C to stop "
               "forwarding)")
    try:
        ctx.exit(run_child(argv) if argv else 0)
    except KeyboardInterrupt:
        ctx.exit(0)


@click.command(context_settings=CONTEXT)
@click.argument("project", required=False, type=click.Path(path_type=Path))
@click.option("--cluster", help="Cluster (default: the default cluster).")
@click.option("--port", type=click.IntRange(1, 65535),
              help="Local port (on 127.0.0.1 only; default 8888); in use here: the next free one, said.")
@click.option("--data", type=click.Path(path_type=Path),
              help="A data directory, pushed as `train --data` pushes it ($GPUCTL_DATA_DIR in the kernels).")
@click.option("--no-open", is_flag=True, help="Print the URL only; do not open a browser.")
@click.option("--stop", "stop_it", is_flag=True, help="End the cluster's notebook server (its kernels with it).")
@json_option
@click.pass_context
def notebook(ctx: click.Context, project: Path | None, cluster: str | None, port: int | None, data: Path | None,
             no_open: bool,
             stop_it: bool, as_json: bool) -> None:
    """JupyterLab on the cluster's chief, in the environment `train` gives PROJECT (default: .; a
    running server is reconnected to with the project it started with: another PROJECT is refused).

    It listens on the instance's 127.0.0.1 only, reached through gpuctl's SSH connection (host
    key pinned) on a local port; its URL carries a token (random per server, never on a command
    line). Ctrl-C ends the forwarding, not the server: its kernels go on, and `gpuctl notebook`
    again reconnects. `gpuctl notebook --stop` (or `gpuctl down`) ends it.

    Counted by the guards: a busy kernel is work; idle kernels are idle, and the idle guard ends
    the server after its limit (`gpuctl status` and the server's log warn first). Its time on the
    cluster is a session in `gpuctl status` and `gpuctl cost`.
    """
    from gpuctl.cli import render
    from gpuctl.cli.common import progress_sink
    from gpuctl.ops import notebook as ops

    s = session(ctx)
    if stop_it:
        stopped = ops.stop(s, cluster)
        if as_json:
            render.emit_json(stopped)
        else:
            click.echo(f"Notebook server on {stopped.cluster} stopped." if stopped.stopped
                       else f"No notebook server ran on {stopped.cluster}.")
        return
    opened = ops.open_notebook(s, cluster, port, project, data, progress_sink())
    if as_json:  # the URL in the JSON; then the forwarding as without --json
        render.emit_json(opened)
        if opened.forward is not None:
            ctx.exit(_forward(opened.forward, opened.local_port, None))
        return
    for note in opened.notes:
        click.echo(f"note: {note}", err=True)
    said = "reconnected to the running server" if opened.reconnected else "started"
    click.echo(f"JupyterLab on {opened.cluster} ({said}): {opened.url}")
    click.echo(f"  notebooks in {opened.workdir} on {opened.host}; yours only: the token; nothing is opened "
               "to the internet", err=True)
    if opened.forward is None:
        if not no_open:
            _open_browser(s.home, opened.url)
        click.echo("  it runs on in the background: `gpuctl notebook --stop` ends it", err=True)
        return
    click.echo("  Ctrl-C ends the forwarding (the server and its kernels go on; `gpuctl notebook` reconnects)",
               err=True)
    ctx.exit(_forward(opened.forward, opened.local_port, None if no_open else lambda: _open_browser(s.home, opened.url)))


def _open_browser(home: Path, url: str) -> None:
    import webbrowser

    from gpuctl.ops.browser import opener

    webbrowser.open(opener(home, "notebook-open.html", url, "JupyterLab"))  # no token on a command line


def _forward(argv: list[str], port: int, ready: Callable[[], None] | None) -> int:
    """The forwarding in the foreground; Ctrl-C (the normal end: exit 0) ends it, never the server."""
    return run_child(argv, ready=ready, port=port, interrupted=0)
