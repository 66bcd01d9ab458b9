"""Data snapshots: `gpuctl data push DIR [--name NAME]`, `data ls`, `data rm NAME`, what
`train --data gpuctl:NAME` resolves to, and what they cost (`cost`).

A snapshot lives in the gpuctl bucket of an AWS region (the aws provider's SnapshotStore: the
checkpoint store's bucket, under data/NAME/), whatever provider the clusters use: an aws cluster
fetches it in its region with its own role, a local or ssh host with links made here (as any
`s3://` data set, ops/datasets.py). The ledger keeps each one's record; `data ls`, `data rm` and
`cost` read it without asking AWS. Every input is checked before anything is uploaded or deleted.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pydantic import BaseModel, ConfigDict

from gpuctl.errors import ConfigError, ConflictError, DataError, NotFoundError
from gpuctl.model import billing
from gpuctl.model.data import S3Source
from gpuctl.model.records import FINAL_RUN_STATES
from gpuctl.model.snapshots import NAME_HINT, Snapshot, check_name, name_of
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.provision import SnapshotStore, provider_class

if TYPE_CHECKING:  # the reports import this module and load no settings' models (issue 39)
    from gpuctl.config.load import LoadedSettings

PRICE = billing.S3_PRICE
MANIFESTS = "snapshots"  # under the gpuctl home: what each snapshot's last push uploaded


class SnapshotInfo(Snapshot):
    """A snapshot with what it costs."""

    monthly_usd: float = 0.0  # while it exists; 0 once removed
    accrued_usd: float = 0.0  # since its first push (at its latest size), until removed
    removed_at: Optional[float] = None


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)


class PushResult(_Result):
    snapshot: SnapshotInfo
    uploaded: int  # files uploaded this time (new or changed)
    uploaded_bytes: int
    unchanged: int  # files already there as they are
    deleted: int  # objects whose file is gone from the directory
    seconds: float


class SnapshotList(_Result):
    snapshots: tuple[SnapshotInfo, ...]
    price: str = PRICE


class SnapshotStorage(_Result):
    """`cost`: what the snapshots cost, from the ledger alone."""

    snapshots: tuple[SnapshotInfo, ...] = ()
    gb: float = 0.0  # of the snapshots that exist
    usd_per_month: float = 0.0
    accrued_usd: float = 0.0  # every snapshot's, removed ones included
    price: str = PRICE


def info(snapshot: Snapshot, removed_at: float | None = None, now: float | None = None) -> SnapshotInfo:
    end = removed_at or (time.time() if now is None else now)
    return SnapshotInfo(**snapshot.model_dump(), removed_at=removed_at,
                        monthly_usd=0.0 if removed_at else snapshot.usd_per_month,
                        accrued_usd=billing.storage_cost(snapshot.gb, snapshot.created_at, end,
                                                         snapshot.usd_per_gb_month))


def _store(s: Session, region: str | None = None) -> SnapshotStore:
    """The aws provider's snapshot store, placed by the current settings (aws.region, aws.profile),
    whatever `provider` says: the snapshots are in S3 for every provider's clusters. `region`:
    that region's instead of aws.region's (a cluster's)."""
    settings = s.settings().settings.model_copy(update={"provider": "aws"})
    if region:
        settings = settings.model_copy(update={"aws": settings.aws.model_copy(update={"region": region})})
    return s.provider(provider_class("aws").spec_from_settings(settings)).snapshot_store()


def _manifest(s: Session, name: str) -> Path:
    return s.home / MANIFESTS / f"{name}.json"


def default_name(directory: Path) -> str:
    """The directory's name as a snapshot's: lowercase, other characters as '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", directory.resolve().name.lower()).strip("-")[:40].strip("-")
    try:
        return check_name(name)
    except ConfigError:
        raise ConfigError(f"the directory's name {directory.resolve().name[:60]!r} makes no data set name",
                          "Name it: `gpuctl data push DIR --name NAME`. " + NAME_HINT) from None


def _files_in(directory: Path) -> bool:
    """Whether the directory holds a regular file (links are not followed, as the push does not)."""
    for top, _dirs, files in os.walk(directory, followlinks=False):
        if any(os.path.isfile(os.path.join(top, f)) and not os.path.islink(os.path.join(top, f)) for f in files):
            return True
    return False


def check_push(directory: Path, name: str | None) -> tuple[Path, str]:
    """The directory (resolved) and the snapshot's name, checked before anything is uploaded."""
    if name is not None:
        check_name(name, "--name")
    from gpuctl.ops import push as pushing  # here: `cost` reads storage() and loads no push code

    resolved = pushing.check_data(directory)
    assert resolved is not None
    if not _files_in(resolved):
        raise DataError(f"{str(directory)!r} holds no files", "Push a directory with the data set's files in it.")
    return resolved, name or default_name(resolved)


def push(s: Session, directory: Path, name: str | None, progress: Progress = quiet,
         region: str | None = None) -> PushResult:
    """Upload the directory's new and changed files to the snapshot (made on its first push);
    remove from it the files that are gone from the directory. `region`: the bucket of that
    region (default: aws.region's)."""
    resolved, name = check_push(directory, name)
    before = s.ledger.snapshot(name)
    store = _store(s, region)
    if before is not None and (before.region, before.bucket) != (store.region, store.bucket):
        raise ConflictError(f"data set {name!r} is in {before.bucket} ({before.region}), not this region's bucket",
                            f"Push with --region {before.region}, or `gpuctl data rm {name}` first.")
    if before is not None and before.source_dir and before.source_dir != str(resolved):
        progress(f"data set {name}: was pushed from {before.source_dir}; now it mirrors {resolved}")
    started, now = time.monotonic(), time.time()
    # Recorded as the first byte is about to go (not before: a refusal, say access denied, records
    # nothing): a push cut short leaves objects that `data ls`, `cost` and `data rm` know of
    # (marked incomplete until a push ends).
    pending = (before or Snapshot(name=name, region=store.region, bucket=store.bucket, files=0, bytes=0,
                                  created_at=now, pushed_at=now)).model_copy(update={"complete": False})
    progress(f"data push: {resolved} -> s3://{store.bucket}/data/{name}/ (changed files only)")
    summary = store.push(name, resolved, _manifest(s, name), progress, lambda: s.ledger.put_snapshot(pending))
    snapshot = pending.model_copy(update={"files": int(summary["files"]), "bytes": int(summary["total_bytes"]),
                                          "pushed_at": time.time(), "source_dir": str(resolved), "complete": True})
    s.ledger.put_snapshot(snapshot)
    s.ledger.event("data-push", f"{name}: {snapshot.files} files, {snapshot.bytes} bytes, "
                                f"{summary['uploaded']} uploaded, {summary['deleted']} deleted")
    return PushResult(snapshot=info(snapshot), uploaded=int(summary["uploaded"]), uploaded_bytes=int(summary["bytes"]),
                      unchanged=int(summary["unchanged"]), deleted=int(summary["deleted"]),
                      seconds=time.monotonic() - started)


def dir_name(directory: Path) -> str:
    """The data set `train --data DIR` uploads DIR as (`[data] upload_dirs`): DIR's name, then 8 hex
    of where it is (this machine and its real path), as its place on a host is named (push.place):
    two directories of one name never share a data set, and DIR pushed again finds its own."""
    from gpuctl.ops import push as pushing  # here: `cost` reads storage() and loads no push code

    name = re.sub(r"[^a-z0-9-]+", "-", pushing.place(directory).lower()).strip("-")
    return check_name(name)


def uploads_dirs(loaded: LoadedSettings, provider: str) -> bool:
    """Whether `train --data DIR` goes up as a data set: `[data] upload_dirs` on, set by the user
    (never a project's file: config/project.py does not list it), on an aws cluster."""
    return provider == "aws" and loaded.settings.data.upload_dirs and not loaded.from_project("data.upload_dirs")


def upload_for_train(s: Session, directory: Path, region: str | None, progress: Progress) -> tuple[S3Source, str]:
    """DIR pushed as its data set (dir_name; changed files only) into the bucket of the cluster's
    region, and what `train` then fetches: (its source, where that came from)."""
    name = dir_name(directory)
    progress(f"data: {directory} goes up as the data set {name} ([data] upload_dirs), changed files only; "
             "each node fetches it in its region")
    done = push(s, directory, name, progress, region)
    progress(f"data: {name}: {done.uploaded:,} file(s) uploaded, {done.unchanged:,} already there")
    return resolve(s, f"gpuctl:{name}"), f"gpuctl:{name}, [data] upload_dirs"


def ls(s: Session) -> SnapshotList:
    return SnapshotList(snapshots=tuple(info(v) for v, _ in s.ledger.snapshots()))


def _named(s: Session, name: str, shown: str) -> Snapshot:
    check_name(name, shown)
    snapshot = s.ledger.snapshot(name)
    if snapshot is None:
        raise NotFoundError(f"no data set named {name!r}",
                            "`gpuctl data ls` lists yours; `gpuctl data push DIR --name NAME` makes one.")
    return snapshot


def resolve(s: Session, text: str) -> S3Source:
    """`gpuctl:NAME` as the S3 data set it is (and marked used now); NotFoundError for none."""
    snapshot = _named(s, name_of(text), "--data gpuctl:NAME:")
    if not snapshot.complete:
        raise DataError(f"data set {snapshot.name!r} is incomplete: its last push did not finish (or runs now)",
                        f"Push it again (`gpuctl data push DIR --name {snapshot.name}`: only what is missing goes), "
                        "then train; nothing was started.")
    s.ledger.snapshot_used(snapshot.name)
    return snapshot.source


def removable(s: Session, name: str) -> Snapshot:
    """The snapshot `data rm NAME` would delete, if it may: it exists, and no run that has not
    ended on a live cluster was given it."""
    snapshot = _named(s, name, "data set name")
    url = snapshot.source.url
    for c in s.ledger.clusters(include_down=False):
        for r in s.ledger.runs(c.id):
            if r.state not in FINAL_RUN_STATES and r.data == url:
                raise ConflictError(f"data set {name!r} is in use by run {r.run_id} on cluster {c.name!r}",
                                    f"Wait for it to end (or `gpuctl stop {r.run_id}`), then `gpuctl data rm {name}`.")
    return snapshot


def remove(s: Session, snapshot: Snapshot) -> SnapshotInfo:
    """Delete a snapshot `removable` let through: its objects, its record, its manifest here."""
    _store(s).remove(snapshot.name)
    s.ledger.snapshot_removed(snapshot.name)
    _manifest(s, snapshot.name).unlink(missing_ok=True)
    s.ledger.event("data-rm", f"{snapshot.name}: {snapshot.files} files, {snapshot.bytes} bytes")
    return info(snapshot, removed_at=time.time())


def kept(s: Session) -> tuple[SnapshotInfo, ...]:
    """The data sets that exist (what `down --all` leaves, and says it leaves)."""
    return ls(s).snapshots


def storage(s: Session, now: float | None = None) -> SnapshotStorage:
    """Every snapshot the ledger knows, removed ones too, with its dollars to date (no cloud call)."""
    rows = tuple(info(v, removed, now) for v, removed in s.ledger.snapshots(include_removed=True))
    kept = [r for r in rows if r.removed_at is None]
    return SnapshotStorage(snapshots=rows, gb=sum(r.gb for r in kept), usd_per_month=sum(r.monthly_usd for r in kept),
                           accrued_usd=sum(r.accrued_usd for r in rows))
