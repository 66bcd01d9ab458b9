"""`gpuctl dashboard`: parses and prints; the page and its server are gpuctl/web/, its use cases
ops/dashboard.py. Imports are inside the command: `gpuctl --help` loads no web framework."""

from __future__ import annotations

from typing import Callable

import click

from gpuctl.cli.common import CONTEXT


@click.command(context_settings=CONTEXT)
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Local port (on 127.0.0.1 only); 0 takes a free one.")
@click.option("--no-open", is_flag=True, help="Print the URL only; do not open a browser.")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=1.0, show_default=True,
              help="Seconds between looks (one look serves every open tab).")
@click.pass_context
def dashboard(ctx: click.Context, port: int, no_open: bool, interval: float) -> None:
    """A live page of every cluster, run, epoch and dollar: served on 127.0.0.1 with a token in its
    URL; Ctrl-C ends it. A second `gpuctl dashboard` prints the running one's URL."""
    from gpuctl.errors import GpuctlError
    from gpuctl.model.dashboard import ActionResult
    from gpuctl.ops import dashboard as ops
    from gpuctl.ledger.schema import gpuctl_home
    from gpuctl.ops.session import Session, open_session
    from gpuctl.web import runtime
    from gpuctl.web.poller import Poller
    from gpuctl.web.words import acted

    home = gpuctl_home()
    held = runtime.claim(home)
    if held is None:  # another one serves this home, or is in its first look
        click.echo(f"A dashboard is running already: {runtime.wait_for_other(home)}")
        return
    ctx.call_on_close(held.close)
    sock = runtime.listen(port)  # before anything starts: a port in use fails here

    def fresh() -> Session:
        return open_session({})

    def act(name: str) -> Callable[[str], ActionResult]:
        def run(target: str) -> ActionResult:
            s = fresh()
            try:
                return acted(name, target, lambda: (ops.stop_run if name == "stop" else ops.release_cluster)(s, target))
            finally:
                s.close()
        return run

    def ask(name: str, target: str) -> str:
        """The question the CLI itself asks before the act, in its words."""
        if name == "stop":
            return f"Stop run {target}? The cluster stays up."
        from gpuctl.cli.render.questions import down
        from gpuctl.ops.release import down_question

        s = fresh()
        try:
            said = down(down_question(s, target))
            return said[:1].upper() + said[1:] + "?"
        except GpuctlError as exc:
            return f"Release cluster {target}? ({exc.message})"
        finally:
            s.close()

    def ready(url: str) -> None:
        click.echo(f"Dashboard: {url}")
        click.echo("Ctrl-C ends it (clusters and runs go on).", err=True)
        if not no_open:
            import webbrowser

            webbrowser.open(runtime.opener(home, url))  # a file that redirects: no token on a command line

    acts = {"stop": act("stop"), "release": act("release")}
    runtime.serve(home, sock, Poller(fresh, interval_s=interval), acts, ask, ready)
