"""The ledger: one SQLite database (WAL) under the gpuctl home holding clusters, instances, runs,
epochs and events. It outlives instances, so reports still work after `gpuctl down`.

Several gpuctl processes may write at once (a `logs -f` beside a `train`, two terminals): every
write is one short `BEGIN IMMEDIATE` transaction and readers never block writers (WAL).
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from gpuctl.types import ClusterRecord, ClusterSpec, EpochReport, InstanceRecord, RunRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    provider TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    terminated_at REAL,
    is_default INTEGER NOT NULL DEFAULT 0,
    spec_json TEXT NOT NULL
);
-- At most one live cluster per name; ended ones keep their name for the reports.
CREATE UNIQUE INDEX IF NOT EXISTS clusters_live_name ON clusters(name) WHERE state = 'up';
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY,
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS epochs (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    epoch INTEGER NOT NULL,
    report_json TEXT NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    cluster TEXT,
    run_id TEXT,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
"""


def gpuctl_home(env: Mapping[str, str] | None = None) -> Path:
    """`$GPUCTL_HOME`, else the platform's user data dir for gpuctl."""
    env = os.environ if env is None else env
    if env.get("GPUCTL_HOME"):
        return Path(env["GPUCTL_HOME"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("gpuctl", appauthor=False))


class Ledger:
    """Typed access to the ledger. Open one per command; it is cheap."""

    def __init__(self, home: Path):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.path = home / "ledger.sqlite3"
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a writer takes the write
        # lock up front and waits (busy_timeout) instead of failing on upgrade.
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout = 30000")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        self._ensure_schema()

    def _ensure_schema(self) -> None:
        exists = self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchone()
        if not exists:
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    # --- clusters -------------------------------------------------------------------------------

    def add_cluster(self, spec: ClusterSpec, make_default: bool = True) -> ClusterRecord:
        """Record a new live cluster; raises sqlite3.IntegrityError if the name is live already."""
        now = time.time()
        with self.write() as db:
            if make_default:
                db.execute("UPDATE clusters SET is_default = 0")
            db.execute(
                "INSERT INTO clusters (name, provider, state, created_at, is_default, spec_json)"
                " VALUES (?, ?, 'up', ?, ?, ?)",
                (spec.name, spec.provider, now, int(make_default), spec.model_dump_json()),
            )
        cluster = self.live_cluster(spec.name)
        assert cluster is not None
        return cluster

    def _cluster_from_row(self, row: tuple) -> ClusterRecord:
        name, provider, state, created, terminated, is_default, spec_json = row
        return ClusterRecord(
            name=name,
            provider=provider,
            state=state,
            created_at=created,
            terminated_at=terminated,
            is_default=bool(is_default),
            spec=ClusterSpec.model_validate_json(spec_json),
        )

    _CLUSTER_COLS = "name, provider, state, created_at, terminated_at, is_default, spec_json"

    def live_cluster(self, name: str) -> ClusterRecord | None:
        row = self._db.execute(
            f"SELECT {self._CLUSTER_COLS} FROM clusters WHERE name = ? AND state = 'up'", (name,)
        ).fetchone()
        return self._cluster_from_row(row) if row else None

    def clusters(self, include_down: bool = True) -> list[ClusterRecord]:
        where = "" if include_down else "WHERE state = 'up'"
        rows = self._db.execute(f"SELECT {self._CLUSTER_COLS} FROM clusters {where} ORDER BY id").fetchall()
        return [self._cluster_from_row(r) for r in rows]

    def default_cluster(self) -> ClusterRecord | None:
        row = self._db.execute(
            f"SELECT {self._CLUSTER_COLS} FROM clusters WHERE state = 'up' AND is_default = 1"
        ).fetchone()
        return self._cluster_from_row(row) if row else None

    def _cluster_id(self, name: str) -> int:
        row = self._db.execute(
            "SELECT id FROM clusters WHERE name = ? ORDER BY state = 'up' DESC, id DESC LIMIT 1", (name,)
        ).fetchone()
        if row is None:
            raise KeyError(name)
        return row[0]

    def mark_cluster_down(self, name: str, at: float | None = None) -> None:
        with self.write() as db:
            db.execute(
                "UPDATE clusters SET state = 'down', terminated_at = ?, is_default = 0"
                " WHERE name = ? AND state = 'up'",
                (at or time.time(), name),
            )

    # --- instances ------------------------------------------------------------------------------

    def _upsert(self, table: str, key_col: str, key: str, cluster: str, record: str) -> None:
        cid = self._cluster_id(cluster)
        with self.write() as db:
            db.execute(
                f"INSERT INTO {table} ({key_col}, cluster_id, record_json) VALUES (?, ?, ?)"
                f" ON CONFLICT({key_col}) DO UPDATE SET record_json = excluded.record_json",
                (key, cid, record),
            )

    def put_instance(self, inst: InstanceRecord) -> None:
        self._upsert("instances", "id", inst.id, inst.cluster, inst.model_dump_json())

    def instances(self, cluster: str) -> list[InstanceRecord]:
        cid = self._cluster_id(cluster)
        rows = self._db.execute("SELECT record_json FROM instances WHERE cluster_id = ? ORDER BY rowid", (cid,))
        return [InstanceRecord.model_validate_json(r[0]) for r in rows]

    # --- runs and epochs ------------------------------------------------------------------------

    def put_run(self, run: RunRecord) -> None:
        self._upsert("runs", "run_id", run.run_id, run.cluster, run.model_dump_json())

    def run(self, run_id: str) -> RunRecord | None:
        row = self._db.execute("SELECT record_json FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return RunRecord.model_validate_json(row[0]) if row else None

    def runs(self, cluster: str | None = None) -> list[RunRecord]:
        if cluster is None:
            rows = self._db.execute("SELECT record_json FROM runs ORDER BY rowid")
        else:
            rows = self._db.execute(
                "SELECT record_json FROM runs WHERE cluster_id = ? ORDER BY rowid", (self._cluster_id(cluster),)
            )
        return [RunRecord.model_validate_json(r[0]) for r in rows]

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
        rows = self._db.execute("SELECT report_json FROM epochs WHERE run_id = ? ORDER BY epoch", (run_id,))
        return [EpochReport.model_validate_json(r[0]) for r in rows]

    # --- events ---------------------------------------------------------------------------------

    def event(self, kind: str, message: str, cluster: str | None = None, run_id: str | None = None) -> None:
        with self.write() as db:
            db.execute(
                "INSERT INTO events (ts, cluster, run_id, kind, message) VALUES (?, ?, ?, ?, ?)",
                (time.time(), cluster, run_id, kind, message),
            )

    def events(self, cluster: str | None = None) -> list[tuple[float, str | None, str | None, str, str]]:
        q = "SELECT ts, cluster, run_id, kind, message FROM events"
        args: tuple = ()
        if cluster is not None:
            q += " WHERE cluster = ?"
            args = (cluster,)
        return list(self._db.execute(q + " ORDER BY id", args))
