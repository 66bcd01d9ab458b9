"""The ledger: one SQLite database (WAL) under the gpuctl home holding clusters, instances, runs,
epochs, events and the machine images gpuctl baked. It outlives instances, so reports still work after `gpuctl down`.

Several gpuctl processes may write at once (a `logs -f` beside a `train`, two terminals): every
write is one short `BEGIN IMMEDIATE` transaction and readers never block writers (WAL).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from gpuctl.provision import BakedImage
from gpuctl.types import (
    ClusterRecord,
    ClusterSpec,
    EpochReport,
    InstanceRecord,
    RunRecord,
)

SCHEMA_VERSION = 3
# Images `gpuctl image bake` made: `cost` reports their storage from here, without asking AWS.
# Removed ones stay (removed_at) for what they cost while they existed.
IMAGES_TABLE = """
CREATE TABLE IF NOT EXISTS images (
    region TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    removed_at REAL,
    record_json TEXT NOT NULL,
    PRIMARY KEY (region, id)
)"""
SCHEMA = IMAGES_TABLE + ";" + """
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
-- At most one live cluster per name (ended ones keep their name for the reports).
CREATE UNIQUE INDEX IF NOT EXISTS clusters_live_name ON clusters(name) WHERE state = 'up';
-- An instance belongs to one cluster: an owned ssh host keeps its id across clusters.
CREATE TABLE IF NOT EXISTS instances (
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    id TEXT NOT NULL,
    record_json TEXT NOT NULL,
    PRIMARY KEY (cluster_id, id)
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
    cluster_id INTEGER,
    cluster TEXT,
    run_id TEXT,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
"""

# Version 1 keyed instances by id alone and events by cluster name.
MIGRATE_1_TO_2 = """
CREATE TABLE instances_v2 (
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    id TEXT NOT NULL,
    record_json TEXT NOT NULL,
    PRIMARY KEY (cluster_id, id)
);
INSERT INTO instances_v2 (cluster_id, id, record_json) SELECT cluster_id, id, record_json FROM instances;
DROP TABLE instances;
ALTER TABLE instances_v2 RENAME TO instances;
ALTER TABLE events ADD COLUMN cluster_id INTEGER;
"""


def gpuctl_home(env: Mapping[str, str] | None = None) -> Path:
    """`$GPUCTL_HOME`, else the platform's user data dir for gpuctl."""
    env = os.environ if env is None else env
    if env.get("GPUCTL_HOME"):
        return Path(env["GPUCTL_HOME"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("gpuctl", appauthor=False))


def make_private(home: Path) -> None:
    """The home holds keys, the ledger (costs, script arguments) and logs: its owner's alone. A
    home found open to others (gpuctl 0.1 made it 0755, its files 0644) is fixed once: group and
    other lose every bit on it and everything in it. Links are not followed out of it."""
    import stat as stat_

    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not stat_.S_IMODE(home.stat().st_mode) & 0o077:
        return
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, stat_.S_IMODE(os.lstat(path).st_mode) & 0o700)
    os.chmod(home, 0o700)


class Ledger:
    """Typed access to the ledger. Open one per command; it is cheap."""

    def __init__(self, home: Path):
        from gpuctl.errors import ConfigError

        self.home = home
        self.path = home / "ledger.sqlite3"
        try:
            make_private(home)
            # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a writer takes the write
            # lock up front and waits (busy_timeout) instead of failing on upgrade.
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 30000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            for part in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                if part.exists() and part.stat().st_mode & 0o077:
                    os.chmod(part, 0o600)  # sqlite creates them by the umask
            self._ensure_schema()
        except sqlite3.DatabaseError as exc:
            readonly = "readonly" in str(exc) or "unable to open" in str(exc)
            raise ConfigError(f"the ledger {self.path} cannot be {'written' if readonly else 'read'}: {exc}",
                              "Make the gpuctl home writable (GPUCTL_HOME points elsewhere if need be)." if readonly
                              else f"Move it aside (`mv '{self.path}' '{self.path}.broken'`) to start a new one; "
                              "`gpuctl status --all` finds what runs in the cloud by its tags.") from None
        except PermissionError as exc:
            raise ConfigError(f"the gpuctl home {home} is not usable: {exc.strerror} ({exc.filename})",
                              "Make it yours and writable, or point GPUCTL_HOME at another directory.") from None

    def _ensure_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            from gpuctl.errors import ConfigError

            raise ConfigError(f"the ledger {self.path} was written by a newer gpuctl (schema {version}, this one "
                              f"knows {SCHEMA_VERSION})", "Upgrade gpuctl (pip install -U gpuctl), or point "
                              "GPUCTL_HOME at another directory.")
        with self.write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]  # another process may have done it
            exists = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchone()
            if exists and version < 2:
                self._migrate_1_to_2(db)
            if exists and version < 3:
                db.execute(IMAGES_TABLE)
            elif not exists:
                for statement in filter(str.strip, SCHEMA.split(";")):
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @staticmethod
    def _migrate_1_to_2(db: sqlite3.Connection) -> None:
        for statement in filter(str.strip, MIGRATE_1_TO_2.split(";")):
            db.execute(statement)
        # Version 1 recorded only what the user asked for, and priced aws clusters by EC2's rules
        # without saying so in the spec.
        for cid, provider, spec_json in db.execute("SELECT id, provider, spec_json FROM clusters").fetchall():
            spec = json.loads(spec_json)
            spec["version"] = 1
            if provider == "aws":
                spec.setdefault("billing", "per-second")
            db.execute("UPDATE clusters SET spec_json = ? WHERE id = ?", (json.dumps(spec), cid))
        # An event belongs to the newest cluster of its name created before it.
        db.execute("UPDATE events SET cluster_id = (SELECT MAX(c.id) FROM clusters c"
                   " WHERE c.name = events.cluster AND c.created_at <= events.ts)")

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
        return self.cluster(cid)

    @staticmethod
    def _cluster_from_row(row: tuple) -> ClusterRecord:
        cid, name, provider, state, created, terminated, is_default, spec_json = row
        return ClusterRecord(id=cid, name=name, provider=provider, state=state, created_at=created,
                             terminated_at=terminated, is_default=bool(is_default),
                             spec=ClusterSpec.model_validate_json(spec_json))

    def _one(self, where: str, args: tuple) -> ClusterRecord | None:
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

    def mark_cluster_down(self, cluster_id: int, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE clusters SET state = 'down', terminated_at = ?, is_default = 0"
                       " WHERE id = ? AND state = 'up'", (at or time.time(), cluster_id))

    def reopen_cluster(self, cluster_id: int) -> None:
        """A cluster whose instances all ended (a spot interruption) that recovery gives a new one;
        sqlite3.IntegrityError if another cluster of its name is up by now."""
        with self.write() as db:
            default = db.execute("SELECT 1 FROM clusters WHERE state = 'up' AND is_default = 1").fetchone() is None
            db.execute("UPDATE clusters SET state = 'up', terminated_at = NULL, is_default = ? WHERE id = ?",
                       (int(default), cluster_id))

    def forget_cluster(self, cluster_id: int) -> None:
        """Remove a cluster that never got anything (an `up` that failed before creating a thing)."""
        with self.write() as db:
            if db.execute("SELECT 1 FROM runs WHERE cluster_id = ?", (cluster_id,)).fetchone():
                raise ValueError(f"cluster {cluster_id} has runs")
            for table in ("instances", "events"):
                db.execute(f"DELETE FROM {table} WHERE cluster_id = ?", (cluster_id,))
            db.execute("DELETE FROM clusters WHERE id = ?", (cluster_id,))

    # --- instances ------------------------------------------------------------------------------

    def put_instance(self, cluster_id: int, inst: InstanceRecord) -> None:
        with self.write() as db:
            db.execute("INSERT INTO instances (cluster_id, id, record_json) VALUES (?, ?, ?)"
                       " ON CONFLICT(cluster_id, id) DO UPDATE SET record_json = excluded.record_json",
                       (cluster_id, inst.id, inst.model_dump_json()))

    def instances(self, cluster_id: int) -> list[InstanceRecord]:
        rows = self._db.execute("SELECT record_json FROM instances WHERE cluster_id = ? ORDER BY rowid", (cluster_id,))
        return [InstanceRecord.model_validate_json(r[0]) for r in rows]

    # --- runs and epochs ------------------------------------------------------------------------

    def put_run(self, run: RunRecord) -> None:
        if not run.cluster_id:
            raise ValueError(f"run {run.run_id} has no cluster id")
        with self.write() as db:
            db.execute("INSERT INTO runs (run_id, cluster_id, record_json) VALUES (?, ?, ?)"
                       " ON CONFLICT(run_id) DO UPDATE SET record_json = excluded.record_json,"
                       " cluster_id = excluded.cluster_id",  # a run resumed on another cluster moves there
                       (run.run_id, run.cluster_id, run.model_dump_json()))

    @staticmethod
    def _run_from_row(row: tuple) -> RunRecord:
        # The column is the truth: records written by version 1 carry no cluster id.
        return RunRecord.model_validate_json(row[0]).model_copy(update={"cluster_id": row[1]})

    def run(self, run_id: str) -> RunRecord | None:
        row = self._db.execute("SELECT record_json, cluster_id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return self._run_from_row(row) if row else None

    def runs(self, cluster_id: int | None = None) -> list[RunRecord]:
        q = "SELECT record_json, cluster_id FROM runs"
        args: tuple = ()
        if cluster_id is not None:
            q += " WHERE cluster_id = ?"
            args = (cluster_id,)
        return [self._run_from_row(r) for r in self._db.execute(q + " ORDER BY rowid", args)]

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

    def event(self, kind: str, message: str, cluster: ClusterRecord | None = None, run_id: str | None = None) -> None:
        with self.write() as db:
            db.execute(
                "INSERT INTO events (ts, cluster_id, cluster, run_id, kind, message) VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), cluster.id if cluster else None, cluster.name if cluster else None, run_id, kind, message),
            )

    def events(self, cluster_id: int | None = None) -> list[tuple[float, str | None, str | None, str, str]]:
        q = "SELECT ts, cluster, run_id, kind, message FROM events"
        args: tuple = ()
        if cluster_id is not None:
            q += " WHERE cluster_id = ?"
            args = (cluster_id,)
        return list(self._db.execute(q + " ORDER BY id", args))

    # --- images ---------------------------------------------------------------------------------

    def put_image(self, image: BakedImage) -> None:
        with self.write() as db:
            db.execute("INSERT INTO images (region, id, created_at, record_json) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT(region, id) DO UPDATE SET record_json = excluded.record_json",
                       (image.region, image.id, image.created_at, image.model_dump_json()))

    def image_removed(self, region: str, image_id: str, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE images SET removed_at = ? WHERE region = ? AND id = ? AND removed_at IS NULL",
                       (at or time.time(), region, image_id))

    def images(self, include_removed: bool = True) -> list[tuple[BakedImage, float | None]]:
        """(image, when it was removed or None), oldest first."""
        where = "" if include_removed else "WHERE removed_at IS NULL"
        rows = self._db.execute(f"SELECT record_json, removed_at FROM images {where} ORDER BY created_at, id")
        return [(BakedImage.model_validate_json(record), removed) for record, removed in rows]
