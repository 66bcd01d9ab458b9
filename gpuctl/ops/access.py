"""Interactive access to a cluster: a shell or one command line (`gpuctl ssh`), a run's tmux
session (`attach`), an ssh config for plain `ssh CLUSTER`, and TensorBoard forwarded to here.

These return what to run (argv and cwd); the CLI runs it and passes its exit status through."""

from __future__ import annotations

import os
import posixpath
import secrets
import shlex
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from gpuctl.errors import ConflictError, RemoteError
from gpuctl.model.endpoint import Endpoint
from gpuctl.model.records import ClusterRecord
from gpuctl.model.results import SshConfigResult
from gpuctl.ops import guards, setup
from gpuctl.ops.session import Session
from gpuctl.remote import jobs, tmux
from gpuctl.remote.host import Host
from gpuctl.remote.ssh import openssh
from gpuctl.retry import TimedOut, poll

TENSORBOARD_PORT = 6006  # on the instance, bound to 127.0.0.1 there, behind a token


Runner = Callable[[list[str], Optional[str]], int]  # runs argv in the foreground; its exit status


def shell(s: Session, cluster: str | None, command: list[str] | None, runner: Runner) -> int:
    """A login shell on the cluster's first host, or `command` there; its exit status. Like
    `ssh host cmd`, the words are joined with spaces into one shell line, so `'echo $HOME; exit 3'`
    runs as written. A command counts as activity for the watchdog while it runs; a shell is an
    interactive login, which the watchdog sees itself (and stops counting once quiet for `idle`)."""
    record = s.resolve_cluster(cluster)
    _, host = s.host(record)
    argv, cwd = host.interactive(" ".join(command) if command else None, tty=not command)
    with s.working(record, "ssh") if command else nullcontext():
        return runner(argv, cwd)


def attach_command(s: Session, run_id: str | None) -> tuple[list[str], str | None, ClusterRecord]:
    """(argv, cwd, cluster) attaching to the run's live tmux session."""
    run, cluster = s.run_on_live_cluster(run_id)
    _, host = s.host(cluster)
    tmux = ["tmux", "-L", host.tmux_socket, "attach-session", "-t", f"={run.run_id}"]
    return (*host.interactive(shlex.join(tmux), tty=True), cluster)


def attach(s: Session, run_id: str | None, runner: Runner) -> int:
    """Attach to the run's tmux session until the user detaches; the exit status. No heartbeat:
    it is an interactive login, counted by the watchdog only while its terminal sees input."""
    argv, cwd, _ = attach_command(s, run_id)
    return runner(argv, cwd)


def ssh_config(s: Session, install: bool = False) -> SshConfigResult:
    """Write $GPUCTL_HOME/ssh_config with a Host entry per live remote host; optionally Include it."""
    lines = ["# Written by `gpuctl ssh-config`; rewritten each time. Do not edit.", ""]
    names = []
    for c in s.ledger.clusters(include_down=False):
        remote = [i for i in s.ledger.instances(c.id) if i.ssh_user and i.public_ip]  # reached over SSH
        for n, inst in enumerate(remote):
            alias = c.name if n == 0 else f"{c.name}-{n}"
            names.append(alias)
            # The same block gpuctl's own OpenSSH calls use: its known_hosts, strict checking, and
            # every jump host recorded at `up`, each checked too.
            lines += openssh.host_block(alias, Endpoint.from_record(inst), s.home) + [""]
    path = s.home / "ssh_config"
    path.write_text("\n".join(lines))
    included = None
    if install:
        user_cfg = Path(s.env.get("HOME", str(Path.home()))) / ".ssh" / "config"
        # Quoted: the default home on macOS ("Application Support") has a space.
        include = f'Include "{path}"' if " " in str(path) else f"Include {path}"
        text = user_cfg.read_text() if user_cfg.exists() else ""
        if include not in text.splitlines():
            user_cfg.parent.mkdir(mode=0o700, exist_ok=True)
            # Include must come before any Host block to apply to every host.
            user_cfg.write_text(include + "\n" + text)
            os.chmod(user_cfg, 0o600)
        included = str(user_cfg)
    return SshConfigResult(path=str(path), hosts=tuple(names), included_from=included)


def tensorboard(s: Session, cluster: str | None, port: int) -> tuple[list[str] | None, str]:
    """Start TensorBoard over the runs on the instance (once); (forwarding argv or None, URL with
    its token). TensorBoard has no authentication of its own and a loopback port is open to every
    user of a machine: it runs behind a token check (payloads/gpuctl_tensorboard.py), so neither
    another user of the host nor one of this machine (on the forwarded port) gets past it."""
    record = s.resolve_cluster(cluster)
    _, host = s.host(record)
    remote_port = port if host.local else TENSORBOARD_PORT
    paths = jobs.JobPaths(posixpath.join(host.root, "tensorboard"))
    port_file = posixpath.join(paths.run_dir, "port")
    pane = tmux.pane(host, "tensorboard")
    serving = (host.read_bytes(port_file, 0, 16) or b"").decode("ascii", "replace").strip()
    token = _token(host, paths) if pane is not None else None
    ours = host.local and pane is not None and not pane.dead and serving == str(port)
    if not ours and not _port_free(port):
        # Else the URL printed would lead to whoever holds the port (ssh -L only warns).
        raise ConflictError(f"port {port} is in use on this machine",
                            "Pass another local port: `gpuctl tensorboard --port 16006`.")
    setup.ensure(s, record, check=False, install=False)  # TensorBoard lives in the runs' TensorFlow env
    if pane is not None and (pane.dead or serving != str(remote_port) or token is None):
        # Dead (it crashed, or its port was taken), serving another port than the one asked now (a
        # URL printed for it would lead nowhere), or without a token (an older gpuctl's: open to all).
        jobs.stop_job(host, "tensorboard", paths, grace_s=3)
        pane = None
    if pane is None:
        facts = s.facts(host)
        python = facts.python_of(host)
        probe = host.run([python, "-c", "import tensorboard"], check=False)
        if probe.returncode != 0:
            raise RemoteError(f"TensorBoard is not installed for {python} on {host.label}",
                              f"Install it there: `{python} -m pip install tensorboard`.")
        host.remove_tree(paths.run_dir)  # its last log and exit code are not this start's
        jobs.private_dir(host, paths.run_dir)  # the token's file is written in a directory of the owner's alone
        token = secrets.token_urlsafe(24)
        host.write_text(_token_file(paths), token, mode=0o600)
        cmd = [python, posixpath.join(guards.push_payload(host, facts), TENSORBOARD_PAYLOAD),
               posixpath.join(host.root, "runs"), str(remote_port), _token_file(paths)]
        jobs.start_job(host, "tensorboard", host.root, cmd, {}, paths)
        host.write_text(port_file, str(remote_port))
        _wait_serving(host, paths)
    # Bound to 127.0.0.1 on the instance, reached through this SSH tunnel, and the token's alone.
    return host.forward(port, remote_port), f"http://127.0.0.1:{port}/?token={token}"


TENSORBOARD_PAYLOAD = "gpuctl_tensorboard.py"


def _token_file(paths: jobs.JobPaths) -> str:
    return posixpath.join(paths.run_dir, "token")


def _token(host: Host, paths: jobs.JobPaths) -> str | None:
    """The running TensorBoard's token, as written on the host (URL-safe, 32 characters); None
    when there is none that could be (a TensorBoard an older gpuctl started without one)."""
    raw = (host.read_bytes(_token_file(paths), 0, 64) or b"").decode("ascii", "replace").strip()
    return raw if len(raw) == 32 and all(c.isalnum() or c in "-_" for c in raw) else None


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


TENSORBOARD_START_S = 90.0  # it imports TensorFlow first: tens of seconds on a small instance


def _wait_serving(host: Host, paths: jobs.JobPaths) -> None:
    """Until TensorBoard says it serves; a clear error (its last line) if it ends instead."""
    def ready() -> bool | None:
        log = (host.read_bytes(paths.log) or b"").decode("utf-8", "replace")
        if "TensorBoard " in log and " at http" in log:
            return True
        p = tmux.pane(host, "tensorboard")
        if p is None or p.dead:
            last = jobs.tail_text(host, paths.log, 1) or "no output"
            raise RemoteError(f"TensorBoard did not start on {host.label}: {last}",
                              "Is the port free? Pass another --port, or see `gpuctl exec -- ss -ltn`.")
        return None

    try:
        poll(ready, TENSORBOARD_START_S, first_delay_s=0.5, max_delay_s=2.0)
    except TimedOut:
        raise RemoteError(f"TensorBoard did not answer within {TENSORBOARD_START_S:.0f}s on {host.label}",
                          "Try again; `gpuctl exec -- tail tensorboard/output.log` says what it does.") from None
