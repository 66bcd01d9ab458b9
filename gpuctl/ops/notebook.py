"""`gpuctl notebook`: JupyterLab on the cluster's chief, in the environment `train` gives the
project, on the instance's loopback only, reached here through the SSH connection gpuctl trusts.

One notebook server per cluster, in ROOT/notebook/ (the owner's alone: its token, its port, its
Jupyter config, its log), its notebooks' root ROOT/notebook/work (the project's code linked in as
a run's is, its --data beside it at work/data, $GPUCTL_DATA_DIR). The token is random per server,
written in a 0600 file there and read by the payload (payloads/gpuctl_notebook.py): never in a
command line. The watchdog asks the server's own API whether a kernel is busy (gpuctl_nbwatch.py).
Its time on the cluster is a session in the ledger (events notebook-start / notebook-end), priced
at the cluster's rate in `status` and `cost` (ops/notebook_state.py: what the reports read).
"""

from __future__ import annotations

import posixpath
import secrets
import socket
import time
from pathlib import Path

from gpuctl.config.load import LoadedSettings
from gpuctl.errors import ConflictError, GpuctlError, NoClusterError, RemoteError
from gpuctl.model.records import ClusterRecord
from gpuctl.model.specs import Frozen
from gpuctl.ops import clusters, guards, packages, push, setup
from gpuctl.ops import notebook_state as state
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.payloads.gpuctl_nbwatch import PORT_FILE, TOKEN_FILE
from gpuctl.remote import guard, jobs, tmux
from gpuctl.remote.host import Host
from gpuctl.remote.sync.private import Private
from gpuctl.retry import TimedOut, poll

PAYLOAD = "gpuctl_notebook.py"
START_S = 120.0  # JupyterLab's start on a small instance: seconds; a first import of its extensions more
INSTALL_S = 900.0
PORTS_TRIED = 100  # a local port in use: the next ones, up to this many
DEFAULT_PORT = 8888  # Jupyter's own


class NotebookOpened(Frozen):
    """What `gpuctl notebook` found or started: the URL (its token), the local port, and the argv
    that forwards it (None on `local`: the server listens here)."""

    cluster: str
    host: str
    url: str
    local_port: int
    remote_port: int
    asked_port: int  # what --port asked: another was taken where it was in use here
    reconnected: bool  # a server that ran already (its kernels as they were)
    forward: list[str] | None
    workdir: str
    notes: tuple[str, ...] = ()


class NotebookStopped(Frozen):
    cluster: str
    stopped: bool  # False: none ran


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        # As the servers bind (SO_REUSEADDR): a port whose last connections wait out TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_local_port(asked: int) -> int:
    """`asked` if free here, else the next free one."""
    for port in range(asked, min(asked + PORTS_TRIED, 65536)):
        if port_free(port):
            return port
    raise ConflictError(f"ports {asked}-{asked + PORTS_TRIED - 1} on 127.0.0.1 are all in use here",
                        "Pass another --port.")


def open_notebook(s: Session, cluster: str | None, port: int | None, project: Path | None, data: Path | None,
                  progress: Progress = quiet) -> NotebookOpened:
    """Reconnect to the cluster's notebook server, or start one (the project pushed as `train`
    pushes it, in `train`'s environment, JupyterLab installed there where it lacks it). `project`
    None: the current directory for a new server, whatever the running one serves otherwise;
    `port` None: DEFAULT_PORT, said only where it was asked."""
    asked = None if project is None else _project(project)  # a bad PROJECT fails before anything is asked
    wanted = port or DEFAULT_PORT
    data = push.check_data(data)
    record = clusters.reconcile(s, s.resolve_cluster(cluster))  # a guard's poweroff: EC2 ended it
    if record.state != "up":
        why = "; ".join(sorted({i.state_reason for i in s.ledger.instances(record.id) if i.state_reason}))
        raise NoClusterError(f"cluster {record.name!r} ended meanwhile" + (f" ({why})" if why else "")
                             + ": a guard powered it off, or its provider ended it",
                             "Start a new one with `gpuctl up` (`gpuctl cost` shows what the last one cost).")
    notes: list[str] = []
    with s.cluster_lock(record, progress) as record:
        if record.state != "up":
            raise ConflictError(f"cluster {record.name!r} was released meanwhile", "Start one with `gpuctl up`.")
        inst, host = s.host(record)
        with s.working(record, "notebook"):
            found = state.running(host)
            fired = _fired_since_start(s, record, host)
            state.settle(s, record, host)  # a server that ended (the guard, a crash) ends its session
            if fired is not None and found is None:
                notes.append(f"the cluster's {fired} ended the last notebook server; starting a new one "
                             "(`gpuctl up` starts a new cluster if this one is not wanted any more)")
            if found is not None:
                _check_served(s, record, host, asked, data, notes)  # before anything of it changes
            if found is not None and host.local:  # it listens here already: --port was for a new one
                local_port = found[0]
                if port is not None and local_port != port:
                    notes.append(f"the running server listens on {local_port} (--port applies to a new server)")
            else:
                local_port = free_local_port(wanted)
                if local_port != wanted:
                    notes.append(f"port {wanted} is in use here: using {local_port}")
            if found is not None:
                remote_port, token = found
                reconnected = True
            else:
                project = asked or _project(Path("."))
                loaded = s.settings(project_dir=project)
                remote_port, token = _start(s, loaded, record, host, project, data, local_port, progress)
                if host.local:
                    local_port = remote_port
                reconnected = False
            workdir = posixpath.join(state.paths_of(host).run_dir, "work")
    return NotebookOpened(cluster=record.name, host=host.label, url=f"http://127.0.0.1:{local_port}/lab?token={token}",
                          local_port=local_port, remote_port=remote_port, asked_port=wanted, reconnected=reconnected,
                          forward=host.forward(local_port, remote_port), workdir=workdir, notes=tuple(notes))


def _project(project: Path) -> Path:
    project = push.project_dir(project)
    Private().check_root(str(project))
    return project


def _check_served(s: Session, record: ClusterRecord, host: Host, asked: Path | None, data: Path | None,
                  notes: list[str]) -> None:
    """A running server serves the project it was started with, as pushed then: another PROJECT
    is refused (nothing is pushed over the files its kernels use); what it serves is said."""
    served = state.served_project(s, record, host.label)
    if asked is not None and served is not None and served != str(asked):
        raise ConflictError(f"the notebook server on {record.name} serves {served}, not {asked}",
                            "Stop it first (`gpuctl notebook --stop`: its kernels end), then start one for "
                            "this project.")
    notes.append(f"the running server has {served or 'its project'} as it was pushed at its start: "
                 "`gpuctl notebook --stop`, then `gpuctl notebook`, pushes edits made since")
    if data is not None:
        notes.append("--data applies to a new server: the running one keeps the data it started with")


def _start(s: Session, loaded: LoadedSettings, record: ClusterRecord, host: Host, project: Path, data: Path | None,
           local_port: int, progress: Progress) -> tuple[int, str]:
    """Start the server (nothing of it left running when it fails); (its port on the host, token)."""
    paths = state.paths_of(host)
    if tmux.pane(host, state.SESSION) is not None:
        jobs.stop_job(host, state.SESSION, paths, grace_s=3)  # dead, or alive without serving: a fresh one
    found = setup.ensure(s, record, progress, check=False)  # train's TensorFlow env
    python = next((e.python for e in found if e.host == host.label), s.facts(host).python_of(host))
    wanted = packages.requirements_of(loaded, project)
    if wanted is not None:
        python, _ = packages.ensure(s, host, python, wanted[0], wanted[1], record.spec.remote.wheelhouse,
                                    lambda line: progress(f"packages: {line}"))
    _ensure_jupyterlab(host, python, progress)
    code_stats, data_stats, code_dir, data_dir = push.push_all(host, project, data, progress)
    for name in (TOKEN_FILE, PORT_FILE, "serving", jobs.LOG, "exitcode", "ended", "started"):
        host.run(["rm", "-f", "--", posixpath.join(paths.run_dir, name)], check=False)
    jobs.private_dir(host, paths.run_dir)
    work = posixpath.join(paths.run_dir, "work")
    push.submit(host, work, code_dir, data_dir)
    token = secrets.token_urlsafe(24)
    host.write_text(posixpath.join(paths.run_dir, TOKEN_FILE), token, mode=0o600)
    env = {"GPUCTL_NODE_RANK": "0", "GPUCTL_NUM_NODES": "1"}
    if data_dir is not None:
        env["GPUCTL_DATA_DIR"] = posixpath.join(work, "data")
    cmd = [python, posixpath.join(guards.push_payload(host, s.facts(host)), PAYLOAD), paths.run_dir,
           posixpath.join(work, "code"), str(local_port if host.local else 0)]
    jobs.start_job(host, state.SESSION, posixpath.join(work, "code"), cmd, env, paths)
    try:
        port = _wait_serving(host, paths)
    except GpuctlError:
        jobs.stop_job(host, state.SESSION, paths, grace_s=3)  # nothing left half-running
        raise
    s.ledger.event(state.STARTED, f"JupyterLab on {host.label} ({project})", cluster=record)
    progress(f"watchdog: {guards.install(s, loaded, record)}")
    return port, token


def _ensure_jupyterlab(host: Host, python: str, progress: Progress) -> None:
    """JupyterLab for `python` on the host, installed with its pip where it lacks it; a RemoteError
    with pip's last line when that fails (nothing started yet)."""
    probe = host.run([python, "-c", "import jupyterlab, ipykernel"], check=False)
    if probe.returncode == 0:
        return
    progress(f"JupyterLab: installing it for {python} on {host.label}")
    res = host.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "jupyterlab"],
                   check=False, timeout=INSTALL_S)
    if res.returncode != 0:
        lines = [line for line in (res.stderr or res.stdout or "").splitlines() if line.strip()]
        last = lines[-1].strip()[:300] if lines else f"pip exited {res.returncode}"
        raise RemoteError(f"JupyterLab could not be installed for {python} on {host.label}: {last}",
                          "Install it there yourself (`gpuctl exec -- " + python + " -m pip install jupyterlab`), "
                          "or add jupyterlab to the project's requirements.txt.")


def _wait_serving(host: Host, paths: jobs.JobPaths) -> int:
    def ready() -> int | None:
        port = state.serving_port(host, paths)
        if port is not None:
            return port
        p = tmux.pane(host, state.SESSION)
        if p is None or p.dead:
            last = jobs.tail_text(host, paths.log, 1) or "no output"
            raise RemoteError(f"JupyterLab did not start on {host.label}: {last}",
                              "See its log: `gpuctl exec -- tail notebook/output.log`.")
        return None

    try:
        return poll(ready, START_S, first_delay_s=0.3, max_delay_s=1.0)
    except TimedOut:
        raise RemoteError(f"JupyterLab did not answer within {START_S:.0f}s on {host.label}",
                          "Try again; `gpuctl exec -- tail notebook/output.log` says what it does.") from None


def _fired_since_start(s: Session, record: ClusterRecord, host: Host) -> str | None:
    """'idle guard (at HH:MM:SS)' when a guard fired while the cluster's last notebook server ran
    (a look since may have ended its session already, when the server ended: not before the firing)."""
    last = state.last_session(s, record)
    if last is None:
        return None
    start, end = last
    fired = guard.fired(host, s.notes)
    at = float(fired.get("at") or 0) if isinstance(fired, dict) else 0.0
    if not at or at < start or (end is not None and end < at - 1.0):
        return None
    return f"{fired.get('reason')} guard (at {time.strftime('%H:%M:%S', time.localtime(float(fired['at'])))})"


def stop(s: Session, cluster: str | None) -> NotebookStopped:
    """End the cluster's notebook server (its kernels with it) and its session."""
    record = s.resolve_cluster(cluster)
    _, host = s.host(record)
    paths = state.paths_of(host)
    was = tmux.pane(host, state.SESSION)
    if was is None or was.dead:
        state.settle(s, record, host)  # it ended by itself (the guard, a crash): its session ends when it did
    if was is not None:
        jobs.stop_job(host, state.SESSION, paths, grace_s=5)
    if state.last_start(s, record) is not None:
        state.record_end(s, record, time.time(), "gpuctl notebook --stop")
    return NotebookStopped(cluster=record.name, stopped=was is not None and not was.dead)


