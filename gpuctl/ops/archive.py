"""A released cluster's run logs, kept in the gpuctl home for `gpuctl logs` after `down`.

`down` is the brake, so keeping logs may never hold it: `take` reads each log's tail from the
hosts before the release (bounded in bytes and time: a log the instance made huge, or linked to
/dev/zero, costs no more than its cap), and `keep` writes them into the home after the release,
each only if it fits on that disk. What is skipped is said, never raised.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from gpuctl.errors import GpuctlError
from gpuctl.files import write_private
from gpuctl.model.records import FINAL_RUN_STATES, ClusterRecord
from gpuctl.ops import nodes
from gpuctl.ops.run_state import archived_log
from gpuctl.ops.session import Progress, Session
from gpuctl.remote.sync import size_text

LOG_BYTES = 8 << 20  # of one log's end: what `gpuctl logs` shows after `down`
TOTAL_BYTES = 64 << 20  # of all the logs one `down` holds in memory between its reads and writes
TAKE_S = 20.0  # reading the logs, all hosts together, before the release goes ahead anyway
RESERVE_BYTES = 1 << 20  # left free on the home's disk for the ledger's own writes


@dataclass(frozen=True)
class Taken:
    run_id: str
    node: int
    data: bytes
    cut: bool  # the log was longer than what was taken: its end is kept


def take(s: Session, cluster: ClusterRecord, say: Progress) -> list[Taken]:
    """The end of every log of the cluster's runs not archived yet, read from their hosts."""
    taken: list[Taken] = []
    budget = TOTAL_BYTES
    until = time.monotonic() + TAKE_S
    skipped: list[str] = []
    for run in s.ledger.runs(cluster.id):
        if run.state in FINAL_RUN_STATES and archived_log(s, run.run_id).exists():
            continue
        try:
            each = nodes.of_run(s, cluster, run)
        except GpuctlError as exc:
            skipped.append(f"{run.run_id} ({exc.message})")
            continue
        for n in each:
            cap = min(LOG_BYTES, budget)
            if cap < 64 << 10 or time.monotonic() > until:
                skipped.append(f"{run.run_id} (over {TOTAL_BYTES >> 20} MiB or {TAKE_S:.0f} s of logs)")
                continue
            try:
                # One byte more than kept: whether the log was longer than its cap.
                data = n.host.read_bytes(n.paths(run).log, -(cap + 1), cap + 1)
            except (GpuctlError, OSError) as exc:  # keeping a log never holds the brake
                skipped.append(f"{run.run_id} ({getattr(exc, 'message', None) or exc})")
                continue
            if data is None:
                continue
            budget -= min(len(data), cap)
            taken.append(Taken(run.run_id, n.rank, data[-cap:], len(data) > cap))
    if skipped:
        say(f"logs not kept: {'; '.join(skipped[:3])}" + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""))
    return taken


def keep(s: Session, taken: list[Taken], say: Progress) -> list[str]:
    """Write what `take` read into the home, each log only if it fits on that disk (a reserve
    kept for the ledger); what was not kept, said and returned."""
    missed: list[str] = []
    for t in taken:
        path = archived_log(s, t.run_id, t.node)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.statvfs(path.parent)
            if len(t.data) + RESERVE_BYTES > st.f_bavail * st.f_frsize:
                missed.append(f"{t.run_id}: {size_text(len(t.data))} do not fit on the disk of {s.home}")
                continue
            write_private(path, t.data)
        except OSError as exc:
            missed.append(f"{t.run_id}: {exc.strerror or exc}")
            continue
        if t.cut:
            say(f"kept the last {size_text(len(t.data))} of run {t.run_id}'s log (it was longer)")
    if missed:
        say(f"logs not kept: {'; '.join(missed[:3])}" + (f" and {len(missed) - 3} more" if len(missed) > 3 else ""))
    return missed
