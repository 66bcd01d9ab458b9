"""What a `gpuctl notebook` server is on its host and was in the ledger: whether it runs and
answers (ROOT/notebook: its tmux session, `serving` port, token, exit code), its sessions (ledger
events notebook-start / notebook-end) and what they cost at the cluster's rate. The reports
(`status`, `cost`) read these without loading the code that starts a server (ops/notebook.py)."""

from __future__ import annotations

import posixpath
import time

from gpuctl.errors import GpuctlError
from gpuctl.model.records import ClusterRecord, InstanceRecord
from gpuctl.model.results import NotebookSession
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Session
from gpuctl.payloads.gpuctl_nbwatch import NOTEBOOK_DIR, TOKEN_FILE
from gpuctl.remote import jobs, tmux
from gpuctl.remote.host import Host

SESSION = NOTEBOOK_DIR  # the tmux session's name (the watchdog stops it by that name)
STARTED, ENDED = "notebook-start", "notebook-end"


def paths_of(host: Host) -> jobs.JobPaths:
    return jobs.JobPaths(posixpath.join(host.root, NOTEBOOK_DIR))


def small(host: Host, path: str, limit: int = 64) -> str:
    return (host.read_bytes(path, 0, limit) or b"").decode("ascii", "replace").strip()


def token_of(host: Host, paths: jobs.JobPaths) -> str | None:
    raw = small(host, posixpath.join(paths.run_dir, TOKEN_FILE))
    return raw if len(raw) == 32 and all(c.isalnum() or c in "-_" for c in raw) else None


def serving_port(host: Host, paths: jobs.JobPaths) -> int | None:
    raw = small(host, posixpath.join(paths.run_dir, "serving"), 16)
    return int(raw) if raw.isdigit() and 0 < int(raw) < 65536 else None


def running(host: Host) -> tuple[int, str] | None:
    """(port on the host, token) of the cluster's notebook server that lives and serves; else None."""
    paths = paths_of(host)
    pane = tmux.pane(host, SESSION)
    if pane is None or pane.dead or host.file_size(paths.exitcode) is not None:
        return None
    port, token = serving_port(host, paths), token_of(host, paths)
    if port is None or token is None:
        return None
    # It still listens (not one in its shutdown, which closed its port first): bash's /dev/tcp there.
    probe = host.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], check=False, timeout=10, probe=True)
    return (port, token) if probe.returncode == 0 else None


def last_session(s: Session, record: ClusterRecord) -> tuple[float, float | None] | None:
    """(start, end or None while open) of the cluster's last notebook session; None: it had none."""
    last: tuple[float, float | None] | None = None
    for ts, _, _, kind, message in s.ledger.events(record.id):
        if kind == STARTED:
            last = (ts, None)
        elif kind == ENDED and last is not None:
            last = (last[0], _end_of(message, ts))
    return last


def served_project(s: Session, record: ClusterRecord, label: str) -> str | None:
    """The project the cluster's open notebook session on host `label` was started with (its start
    event says `JupyterLab on LABEL (PROJECT)`, ops/notebook.py: a label or a path may hold " (");
    None when none is open or it does not say."""
    served = None
    head = f"JupyterLab on {label} ("
    for _, _, _, kind, message in s.ledger.events(record.id):
        if kind == STARTED:
            served = message[len(head):-1] if message.startswith(head) and message.endswith(")") else None
        elif kind == ENDED:
            served = None
    return served


def last_start(s: Session, record: ClusterRecord) -> float | None:
    """When the cluster's open notebook session began; None when none is open."""
    opened = None
    for ts, _, _, kind, _ in s.ledger.events(record.id):
        if kind == STARTED:
            opened = ts
        elif kind == ENDED:
            opened = None
    return opened


def settle(s: Session, record: ClusterRecord, host: Host) -> None:
    """An open session whose server is gone ends in the ledger (when it ended on the host)."""
    start = last_start(s, record)
    if start is None or running(host) is not None:
        return
    raw = small(host, paths_of(host).ended, 32)
    try:
        at = float(raw)
    except ValueError:
        at = time.time()
    record_end(s, record, max(start, min(at, time.time())), "the server ended")


def record_end(s: Session, record: ClusterRecord, at: float, why: str) -> None:
    s.ledger.event(ENDED, f"{at:.3f} {why}", cluster=record)


def sessions(s: Session, records: list[ClusterRecord], now: float) -> tuple[NotebookSession, ...]:
    """Every notebook session of these clusters, priced at each cluster's rate; one still open ends
    now (its cluster up) or when its cluster was released. A look (`status`, `cost`): an open
    session of a live cluster whose server is gone is ended first, when it ended there."""
    out = []
    for c in records:
        if c.state == "up" and last_start(s, c) is not None:
            try:
                settle(s, c, s.hosts(c, connect_timeout_s=REPORT_CONNECT_TIMEOUT_S)[0][1])
            except GpuctlError as exc:
                s.notes.append(f"{c.name}: its notebook server not looked at: {exc.message}")
        instances = s.ledger.instances(c.id)
        opened: float | None = None
        for ts, _, _, kind, message in s.ledger.events(c.id):
            if kind == STARTED:
                opened = ts
            elif kind == ENDED and opened is not None:
                out.append(_priced(c, instances, opened, _end_of(message, ts), False))
                opened = None
        if opened is not None:
            out.append(_priced(c, instances, opened, c.terminated_at or now, c.state == "up"))
    return tuple(out)


def _end_of(message: str, ts: float) -> float:
    try:
        return float(message.split(" ", 1)[0])
    except ValueError:
        return ts


def _priced(c: ClusterRecord, instances: list[InstanceRecord], start: float, end: float, open_: bool) -> NotebookSession:
    # The cluster's rate while it ran (every node's): the notebook holds the chief, the others wait with it.
    rate = sum(i.usd_per_hour for i in instances if i.launched_at <= end and (i.terminated_at or end) >= start)
    seconds = max(0.0, end - start)
    return NotebookSession(cluster=c.name, cluster_id=c.id, started_at=start, ended_at=None if open_ else end,
                           seconds=seconds, usd_per_hour=rate, usd=seconds * rate / 3600.0)
