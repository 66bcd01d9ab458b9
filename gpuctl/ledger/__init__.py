"""The ledger: one SQLite database (WAL) under the gpuctl home holding clusters, instances, runs,
epochs, events, the machine images gpuctl baked, the volumes it made (ledger/volumes.py) and the data snapshots it pushed (ledger/snapshots.py). It outlives instances, so reports still work after `gpuctl down`.

Several gpuctl processes may write at once (a `logs -f` beside a `train`, two terminals): every
write is one short `BEGIN IMMEDIATE` transaction and readers never block writers (WAL).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from gpuctl import retry
from gpuctl.errors import ConfigError, ConflictError, LedgerUnwritable, NotFoundError
from gpuctl.ledger.billed import BilledRows
from gpuctl.ledger import schema
from gpuctl.ledger.schema import SCHEMA_VERSION, make_private
from gpuctl.ledger.snapshots import SnapshotRows
from gpuctl.ledger.stored import epoch_from_row
from gpuctl.ledger.volumes import VolumeRows
from gpuctl.model.images import BakedImage
from gpuctl.model.records import ClusterRecord, EpochReport, InstanceRecord, RunRecord
from gpuctl.model.specs import ClusterSpec, parse_spec


F = TypeVar("F", bound=Callable[..., None])

BUSY_S = 30  # how long a command waits for another gpuctl's write before it says the ledger is held


def _skippable(method: F) -> F:
    """A write that returns nothing: within Ledger.unrecorded(), one the disk cannot take is skipped."""
    @functools.wraps(method)
    def write(self: "Ledger", *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except LedgerUnwritable as exc:
            if self._missed is None:
                raise
            if exc.message not in self._missed:
                self._missed.append(exc.message)
    return write  # type: ignore[return-value]


class Ledger(VolumeRows, SnapshotRows, BilledRows):
    """Typed access to the ledger. Open one per command; it is cheap."""

    def __init__(self, home: Path):
        self.home = home
        self.path = home / "ledger.sqlite3"
        # True when the disk under the home had no room for SQLite's shared-memory index: the
        # ledger is then read (and written, while a write fits) by this process alone.
        self.cramped = False
        self._missed: list[str] | None = None  # within `unrecorded()`: the writes it could not take
        try:
            make_private(home)
            try:
                self._db = self._open(exclusive=False)
            except sqlite3.OperationalError as exc:
                if not (_no_room(exc) and _free(home) < 1 << 20):
                    raise  # only a disk that is really full: one lock for the whole command costs others
                # A full disk: WAL's index file cannot grow, so no connection could read the ledger
                # ("disk I/O error") and every command failed, `down` too. In EXCLUSIVE locking mode
                # SQLite keeps that index in memory, WAL included: reads work and writes fail cleanly.
                self._db = self._open(exclusive=True)
                self.cramped = True
            self._ensure_schema()
        except sqlite3.DatabaseError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise self._unwritable(exc) from None  # held by another gpuctl: a conflict, not a bad file
            readonly = "readonly" in str(exc) or "unable to open" in str(exc)
            if readonly or _no_room(exc):
                raise LedgerUnwritable(f"the ledger {self.path} cannot be {'written' if readonly else 'opened'}: "
                                       f"{_why(exc, home)}", _WRITABLE_HINT) from None
            raise ConfigError(f"the ledger {self.path} cannot be read: {exc}",
                              "Keep it while anything may still run: `gpuctl status --all` finds what runs by its "
                              "tags and `gpuctl down --all -y` releases it; then move the file aside (`mv "
                              f"'{self.path}' '{self.path}.broken'`) to start a new ledger.") from None
        except PermissionError as exc:
            raise ConfigError(f"the gpuctl home {home} is not usable: {exc.strerror} ({exc.filename})",
                              "Make it yours and writable, or point GPUCTL_HOME at another directory.") from None

    def _open(self, exclusive: bool) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a writer takes the write
        # lock up front and waits (busy_timeout) instead of failing on upgrade.
        db = sqlite3.connect(self.path, timeout=BUSY_S, isolation_level=None)
        try:
            if exclusive:
                db.execute("PRAGMA locking_mode = EXCLUSIVE")
            db.execute(f"PRAGMA busy_timeout = {BUSY_S * 1000}")
            db.execute("PRAGMA user_version").fetchone()  # the first read: WAL's index is made here
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                _into_wal(db)  # a new ledger (the read above made the mode known: before it, "delete")
            db.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            db.close()
            raise
        for part in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            if part.exists() and part.stat().st_mode & 0o077:
                os.chmod(part, 0o600)  # sqlite creates them by the umask
        return db

    def _ensure_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise ConfigError(f"the ledger {self.path} was written by a newer gpuctl (schema {version}, this one "
                              f"knows {SCHEMA_VERSION})", "Upgrade gpuctl (pip install -U gpuctl), or point "
                              "GPUCTL_HOME at another directory.")
        with self.write() as db:
            schema.upgrade(db)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def unrecorded(self) -> Iterator[list[str]]:
        """Within it, a write the ledger cannot take (a full or read-only disk) is skipped and its
        reason kept in the yielded list instead of raised: the brake (`down`) goes on without its
        record and says what it could not record. Writes that return what they made still raise."""
        outer, self._missed = self._missed, []
        try:
            yield self._missed
        finally:
            if outer is not None:
                outer.extend(self._missed)
            self._missed = outer

    def _all(self, query: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Every row at once. A cursor left part-read (its rows parsed one by one, and a record
        that fails validation raising out of the loop while a traceback keeps the cursor) holds
        this connection's read snapshot open: after another gpuctl writes, this one's next
        BEGIN IMMEDIATE then fails at once with "database is locked", whatever busy_timeout says."""
        return self._db.execute(query, args).fetchall()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self._unwritable(exc) from None
        try:
            yield self._db
        except BaseException as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError):
                raise self._unwritable(exc) from None
            raise
        else:
            try:
                self._db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                raise self._unwritable(exc) from None

    def _unwritable(self, exc: sqlite3.DatabaseError) -> Exception:
        """A ledger that cannot take a write (read-only file or disk, full disk, held too long by
        another gpuctl): one line that names it, with what to do. Nothing of it is lost: SQLite
        rolled the write back, and what was written before reads as it was."""
        if "locked" in str(exc) or "busy" in str(exc):
            return ConflictError(f"the ledger {self.path} stayed locked by another gpuctl for {BUSY_S} s ({exc})",
                                 "Let the other gpuctl command finish (or end it), then run this one again.")
        return LedgerUnwritable(f"the ledger {self.path} cannot be written: {_why(exc, self.home)}", _WRITABLE_HINT)

    # --- clusters -------------------------------------------------------------------------------

    _CLUSTER_COLS = "id, name, provider, state, created_at, terminated_at, is_default, spec_json"

    def add_cluster(self, spec: ClusterSpec, make_default: bool = True) -> ClusterRecord:
        """Record a new live cluster; raises sqlite3.IntegrityError if the name is live already."""
        with self.write() as db:
            if make_default:
                db.execute("UPDATE clusters SET is_default = 0")
            cur = db.execute(
                "INSERT INTO clusters (name, provider, state, created_at, is_default, spec_json)"
                " VALUES (?, ?, 'up', ?, ?, ?)",
                (spec.name, spec.provider, time.time(), int(make_default), spec.model_dump_json()),
            )
            cid = cur.lastrowid
            assert cid is not None  # an INSERT's row has one
        return self.cluster(cid)

    @staticmethod
    def _cluster_from_row(row: tuple[Any, ...]) -> ClusterRecord:
        cid, name, provider, state, created, terminated, is_default, spec_json = row
        return ClusterRecord(id=cid, name=name, provider=provider, state=state, created_at=created,
                             terminated_at=terminated, is_default=bool(is_default),
                             spec=parse_spec(spec_json))

    def _one(self, where: str, args: tuple[Any, ...]) -> ClusterRecord | None:
        row = self._db.execute(f"SELECT {self._CLUSTER_COLS} FROM clusters WHERE {where}", args).fetchone()
        return self._cluster_from_row(row) if row else None

    def cluster(self, cluster_id: int) -> ClusterRecord:
        found = self._one("id = ?", (cluster_id,))
        if found is None:
            raise KeyError(cluster_id)
        return found

    def live_cluster(self, name: str) -> ClusterRecord | None:
        return self._one("name = ? AND state = 'up'", (name,))

    def clusters(self, include_down: bool = True) -> list[ClusterRecord]:
        where = "" if include_down else "WHERE state = 'up'"
        rows = self._db.execute(f"SELECT {self._CLUSTER_COLS} FROM clusters {where} ORDER BY id").fetchall()
        return [self._cluster_from_row(r) for r in rows]

    def default_cluster(self) -> ClusterRecord | None:
        return self._one("state = 'up' AND is_default = 1", ())

    @_skippable
    def mark_cluster_down(self, cluster_id: int, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE clusters SET state = 'down', terminated_at = ?, is_default = 0"
                       " WHERE id = ? AND state = 'up'", (at or time.time(), cluster_id))

    @_skippable
    def reopen_cluster(self, cluster_id: int) -> None:
        """A cluster whose instances all ended (a spot interruption) that recovery gives a new one;
        sqlite3.IntegrityError if another cluster of its name is up by now."""
        with self.write() as db:
            default = db.execute("SELECT 1 FROM clusters WHERE state = 'up' AND is_default = 1").fetchone() is None
            db.execute("UPDATE clusters SET state = 'up', terminated_at = NULL, is_default = ? WHERE id = ?",
                       (int(default), cluster_id))

    @_skippable
    def forget_cluster(self, cluster_id: int) -> None:
        """Remove a cluster that never got anything (an `up` that failed before creating a thing)."""
        with self.write() as db:
            if db.execute("SELECT 1 FROM runs WHERE cluster_id = ?", (cluster_id,)).fetchone():
                raise ValueError(f"cluster {cluster_id} has runs")
            for table in ("instances", "events"):
                db.execute(f"DELETE FROM {table} WHERE cluster_id = ?", (cluster_id,))
            db.execute("DELETE FROM clusters WHERE id = ?", (cluster_id,))

    # --- instances ------------------------------------------------------------------------------

    @_skippable
    def put_instance(self, cluster_id: int, inst: InstanceRecord) -> None:
        with self.write() as db:
            db.execute("INSERT INTO instances (cluster_id, id, record_json) VALUES (?, ?, ?)"
                       " ON CONFLICT(cluster_id, id) DO UPDATE SET record_json = excluded.record_json",
                       (cluster_id, inst.id, inst.model_dump_json()))

    def instances(self, cluster_id: int) -> list[InstanceRecord]:
        rows = self._all("SELECT record_json FROM instances WHERE cluster_id = ? ORDER BY rowid", (cluster_id,))
        return [InstanceRecord.model_validate_json(r[0]) for r in rows]

    # --- runs and epochs ------------------------------------------------------------------------

    @_skippable
    def put_run(self, run: RunRecord) -> None:
        if not run.cluster_id:
            raise ValueError(f"run {run.run_id} has no cluster id")
        with self.write() as db:
            db.execute("INSERT INTO runs (run_id, cluster_id, record_json) VALUES (?, ?, ?)"
                       " ON CONFLICT(run_id) DO UPDATE SET record_json = excluded.record_json,"
                       " cluster_id = excluded.cluster_id",  # a run resumed on another cluster moves there
                       (run.run_id, run.cluster_id, run.model_dump_json()))

    @staticmethod
    def _run_from_row(row: tuple[Any, ...]) -> RunRecord:
        # The column is the truth: records written by version 1 carry no cluster id (a copy only
        # where they differ: one per run of every report otherwise).
        run = RunRecord.model_validate_json(row[0])
        return run if run.cluster_id == row[1] else run.model_copy(update={"cluster_id": row[1]})

    def run(self, run_id: str) -> RunRecord | None:
        row = self._db.execute("SELECT record_json, cluster_id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return self._run_from_row(row) if row else None

    def resolve_run_id(self, text: str) -> str:
        """The run id `text` names: the exact id, else the one id it is a unique prefix or suffix of (like git).

        Every command's run lookup goes through here (Session.find_run).
        """
        hint = "Run `gpuctl status` to list runs."
        if not text or not text.strip():
            raise NotFoundError("no run named ''", hint)
        if self.run(text) is not None:
            return text  # an exact id wins over any prefix
        ids: list[str] = [r[0] for r in self._all("SELECT run_id FROM runs ORDER BY rowid")]
        found = [i for i in ids if i.startswith(text) or i.endswith(text)]
        if not found:
            raise NotFoundError(f"no run named {text!r}", hint)
        if len(found) > 1:
            shown = ", ".join(found[:5]) + (f" (and {len(found) - 5} more)" if len(found) > 5 else "")
            raise ConflictError(f"{text!r} matches {len(found)} runs: {shown}", "Give more of the run id.")
        return found[0]

    def runs(self, cluster_id: int | None = None) -> list[RunRecord]:
        q = "SELECT record_json, cluster_id FROM runs"
        args: tuple[Any, ...] = ()
        if cluster_id is not None:
            q += " WHERE cluster_id = ?"
            args = (cluster_id,)
        return [self._run_from_row(r) for r in self._all(q + " ORDER BY rowid", args)]

    @_skippable
    def put_epochs(self, reports: list[EpochReport]) -> None:
        if not reports:
            return
        with self.write() as db:
            db.executemany(
                "INSERT INTO epochs (run_id, epoch, report_json) VALUES (?, ?, ?)"
                " ON CONFLICT(run_id, epoch) DO UPDATE SET report_json = excluded.report_json",
                [(r.run_id, r.epoch, r.model_dump_json(by_alias=True)) for r in reports],
            )

    def epochs(self, run_id: str) -> list[EpochReport]:
        rows = self._all("SELECT report_json FROM epochs WHERE run_id = ? ORDER BY epoch", (run_id,))
        return [r for r in map(self._epoch_or_none, rows) if r is not None]

    def last_epoch(self, run_id: str) -> EpochReport | None:
        """The run's latest epoch that today's bounds accept (epochs()[-1], what `status` shows):
        one row read and validated, not all of them, unless the latest is refused."""
        row = self._db.execute("SELECT report_json FROM epochs WHERE run_id = ? ORDER BY epoch DESC LIMIT 1",
                               (run_id,)).fetchone()
        last = self._epoch_or_none(row) if row else None
        if row is None or last is not None:
            return last
        rest = self.epochs(run_id)
        return rest[-1] if rest else None

    @staticmethod
    def _epoch_or_none(row: tuple[Any, ...]) -> EpochReport | None:
        """A stored report, unless it fails today's bounds (a `start` of 1e308 that a gpuctl
        before them let in): then it is left out, as it would be at ingestion now. A row as this
        ledger's writer wrote it is read without EpochReport's Python validators (ledger/stored.py)."""
        return epoch_from_row(row[0])

    # --- events ---------------------------------------------------------------------------------

    @_skippable
    def event(self, kind: str, message: str, cluster: ClusterRecord | None = None, run_id: str | None = None) -> None:
        with self.write() as db:
            db.execute(
                "INSERT INTO events (ts, cluster_id, cluster, run_id, kind, message) VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), cluster.id if cluster else None, cluster.name if cluster else None, run_id, kind, message),
            )

    def last_event(self, cluster_id: int, kinds: tuple[str, ...]) -> tuple[str, str] | None:
        """(kind, message) of the cluster's latest event of these kinds; None when it has none."""
        marks = ", ".join("?" * len(kinds))
        row = self._db.execute(f"SELECT kind, message FROM events WHERE cluster_id = ? AND kind IN ({marks})"
                               " ORDER BY id DESC LIMIT 1", (cluster_id, *kinds)).fetchone()
        return (row[0], row[1]) if row else None

    @_skippable
    def set_spec(self, cluster_id: int, spec: ClusterSpec) -> None:
        """The spec later commands build a live cluster's provider from, changed (`up` setting up
        again, with today's `remote.*`, a cluster whose setup failed)."""
        with self.write() as db:
            db.execute("UPDATE clusters SET spec_json = ? WHERE id = ? AND state = 'up'",
                       (spec.model_dump_json(), cluster_id))

    def events(self, cluster_id: int | None = None) -> list[tuple[float, str | None, str | None, str, str]]:
        q = "SELECT ts, cluster, run_id, kind, message FROM events"
        args: tuple[Any, ...] = ()
        if cluster_id is not None:
            q += " WHERE cluster_id = ?"
            args = (cluster_id,)
        return self._all(q + " ORDER BY id", args)

    # --- images ---------------------------------------------------------------------------------

    @_skippable
    def put_image(self, image: BakedImage) -> None:
        with self.write() as db:
            db.execute("INSERT INTO images (region, id, created_at, record_json) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT(region, id) DO UPDATE SET record_json = excluded.record_json",
                       (image.region, image.id, image.created_at, image.model_dump_json()))

    @_skippable
    def image_removed(self, region: str, image_id: str, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE images SET removed_at = ? WHERE region = ? AND id = ? AND removed_at IS NULL",
                       (at or time.time(), region, image_id))

    def images(self, include_removed: bool = True) -> list[tuple[BakedImage, float | None]]:
        """(image, when it was removed or None), oldest first."""
        where = "" if include_removed else "WHERE removed_at IS NULL"
        rows = self._all(f"SELECT record_json, removed_at FROM images {where} ORDER BY created_at, id")
        return [(BakedImage.model_validate_json(record), removed) for record, removed in rows]


def _into_wal(db: sqlite3.Connection) -> None:
    """Switch a new ledger to WAL. The switch needs the file to itself and SQLite answers "database
    is locked" at once, without its busy wait, when another connection is there: the first command
    of a new home opening a session per thread (`plan`'s probes) lost one of them that way. Retried
    within the busy timeout, as any other lock would be waited for."""
    def attempt() -> bool | None:
        try:
            db.execute("PRAGMA journal_mode = WAL").fetchone()
            return True
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return None
            raise
    try:
        retry.poll(attempt, BUSY_S, first_delay_s=0.01, max_delay_s=0.2)
    except retry.TimedOut:
        raise sqlite3.OperationalError("database is locked") from None


_WRITABLE_HINT = ("Free space on that disk, or make the gpuctl home writable (a read-only disk, an immutable file); "
                  "keep the ledger: it is intact, and what it holds reads as before.")


def _no_room(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's ways of saying the disk is full: SQLITE_FULL, or an I/O error growing a file."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR") or str(exc) in ("database or disk is full", "disk I/O error")


def _free(home: Path) -> int:
    """Bytes free for this user on the disk under the home (a large number when unknown)."""
    try:
        st = os.statvfs(home)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _why(exc: sqlite3.DatabaseError, home: Path) -> str:
    """SQLite's words, with the free space under the home when that is what it lacks."""
    free = _free(home)
    if _no_room(exc) and free < 1 << 20:
        return f"the disk holding it is full ({free // 1024} KiB free)"
    return str(exc)
