"""A run's kept files: what the checkpoint stores hold and cost (`gpuctl cost`), and `gpuctl runs rm`.

Where a cluster's provider has a checkpoint store (aws: an S3 bucket per owner and region), runs
keep their checkpoints and reports there, and they outlive the cluster: `down` never deletes them,
the store's expiry or `runs rm` does. Elsewhere (local, ssh, aws with `aws.checkpoints =
"instance"`) they stay in the run's directory on the host; a local cluster's release keeps that
directory under the gpuctl home (`Provider.kept_run`). `runs rm` deletes a finished run's files
in every such place; the ledger keeps the run's record (its epochs and dollars stay in `cost`).
"""

from __future__ import annotations

import posixpath
from typing import Optional

from pydantic import BaseModel, ConfigDict

from gpuctl.errors import ConflictError, GpuctlError
from gpuctl.model import billing
from gpuctl.model.records import ClusterRecord
from gpuctl.ops import nodes, run_state
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.provision import CheckpointStore

GIB = 1024 ** 3  # S3 bills GB-months of 2^30 bytes


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)


class RunStorage(_Result):
    cluster: str  # the cluster whose place in the store holds it (a resumed run may be in two)
    run_id: str
    bytes: int
    usd_per_month: float


class CheckpointStorage(_Result):
    """`cost`: what the runs' checkpoints cost in the checkpoint stores, asked of the stores now."""

    runs: tuple[RunStorage, ...] = ()
    gb: float = 0.0
    usd_per_month: float = 0.0
    price: str = billing.S3_PRICE
    note: Optional[str] = None  # why some store could not be asked (no credentials, no network)


class RunRemoved(_Result):
    run_id: str
    cluster: str
    store_files: int = 0  # objects deleted from the checkpoint store
    host_dir: Optional[str] = None  # the run's directory removed on its live cluster's host
    note: str = ""  # what was not there to delete


def _stores(s: Session) -> list[tuple[ClusterRecord, CheckpointStore]]:
    """One checkpoint store per provider, region and profile the ledger's clusters used (a store
    is the owner's, not a cluster's: every cluster of a region shares it)."""
    seen, out = set(), []
    for c in s.ledger.clusters():
        key = c.spec.store_key
        if key is None or key in seen:
            continue
        seen.add(key)
        store = s.provider(c.spec).checkpoint_store()
        if store is not None:
            out.append((c, store))
    return out


def storage(s: Session) -> CheckpointStorage:
    """Bytes per run in every store the ledger's clusters used, priced as S3 Standard. A store
    that cannot be asked is left out with a note: `cost` answers anyway."""
    rows: dict[tuple[str, str], int] = {}
    notes = []
    try:
        stores = _stores(s)
    except GpuctlError as exc:
        stores, notes = [], [exc.message]
    for cluster, store in stores:
        try:
            for key, size in store.usage().items():
                rows[key] = rows.get(key, 0) + size
        except GpuctlError as exc:
            notes.append(f"{cluster.spec.scope or cluster.provider}: {exc.message}")
    # A place in the store is `name.id` (ClusterSpec.store_place): shown by its cluster's name.
    names = {c.spec.store_place: c.name for c in s.ledger.clusters()}
    runs = tuple(RunStorage(cluster=names.get(c, c), run_id=r, bytes=b,
                            usd_per_month=b / GIB * billing.S3_STANDARD_USD_PER_GB_MONTH)
                 for (c, r), b in sorted(rows.items()))
    total = sum(r.bytes for r in runs)
    note = ("checkpoint storage not counted for " + "; ".join(notes)) if notes else None
    return CheckpointStorage(runs=runs, gb=total / GIB, usd_per_month=sum(r.usd_per_month for r in runs), note=note)


def remove_question(s: Session, run_id: str) -> str:
    run = s.find_run(run_id)
    return f"delete the checkpoints and files of run {run.run_id} (cluster {run.cluster}) for good"


def remove(s: Session, run_id: str, progress: Progress = quiet) -> RunRemoved:
    """Delete a finished run's checkpoints from its store (under every cluster that holds a copy)
    and its directory on its cluster's host if that is up. A running run is refused."""
    run = run_state.settle_or_keep(s, s.find_run(run_id))
    if run.state in ("starting", "queued", "running"):
        raise ConflictError(f"run {run.run_id} is {run.state}: its checkpoints are in use",
                            f"Wait for it to end (`gpuctl logs -f {run.run_id}`), or stop it with "
                            f"`gpuctl down {run.cluster}`; then `gpuctl runs rm {run.run_id}`.")
    cluster = s.ledger.cluster(run.cluster_id)
    store = s.provider(cluster.spec).checkpoint_store()
    files, notes = 0, []
    if store is not None:
        places = {cluster.spec.store_place} | {c for c, r in store.usage() if r == run.run_id}
        for name in sorted(places):
            files += store.remove(name, run.run_id)
        progress(f"deleted {files} file(s) of run {run.run_id} from the checkpoint store")
    host_dir = None
    live = s.live_cluster_of(run)
    if live is not None:
        try:
            group = nodes.of_run(s, live, run)
            host = group[0].host
            expected = posixpath.join(host.root, "runs", run.run_id)
            if run.run_dir != expected:  # the ledger's path is deleted only where gpuctl itself puts runs
                notes.append(f"its directory {run.run_dir} is not where gpuctl keeps runs ({expected}): left alone")
            else:
                for n in group:  # every node's copy (the others' checkpoints are the chief's)
                    n.host.remove_tree(n.paths(run).run_dir)
                    progress(f"removed {n.paths(run).run_dir} on {n.host.label}")
                host_dir = run.run_dir
        except GpuctlError as exc:
            if store is None:
                raise
            notes.append(f"its directory on cluster {live.name!r} stays ({exc.message}); it goes with the instance")
    kept = s.kept_run(run)
    if kept is not None:
        # What the provider kept when a cluster of the run went (local); also when the run was
        # resumed elsewhere since: that copy is a stale one of the same run.
        kept[0].remove_tree(kept[1])
        progress(f"removed {kept[1]}")
        host_dir = host_dir or kept[1]
    elif live is None and store is None:
        notes.append(f"cluster {run.cluster!r} is down: its files went with its host, or stay there "
                     "(an ssh host: remove them there)")
    s.ledger.event("runs-rm", f"removed {files} stored file(s)" + (f" and {host_dir}" if host_dir else ""),
                   cluster, run.run_id)
    return RunRemoved(run_id=run.run_id, cluster=run.cluster, store_files=files, host_dir=host_dir,
                      note="; ".join(notes))
