"""The ledger's tables (SQLite), their upgrades from older gpuctl versions, and the gpuctl home
they live in (its place, and its privacy: the owner's alone). ledger/__init__.py reads and writes them."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Mapping

from gpuctl.model.specs import spec_fields

SCHEMA_VERSION = 7
# Cost Explorer's daily answers (`cost --billed`; each request costs $0.01): the days asked (with
# rows or none) and the rows, by day, gpuctl:cluster tag value ("" for none) and service.
BILLED_TABLES = """
CREATE TABLE IF NOT EXISTS billed_days (
    day TEXT PRIMARY KEY,
    asked_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS billed (
    day TEXT NOT NULL,
    cluster TEXT NOT NULL,
    service TEXT NOT NULL,
    usd REAL NOT NULL,
    estimated INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (day, cluster, service)
)"""
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
# Volumes (`gpuctl volume create`), recorded from the moment the provider gave an id; removed ones
# stay (removed_at) for what they cost while they existed. One live volume per name.
VOLUMES_TABLE = """
CREATE TABLE IF NOT EXISTS volumes (
    provider TEXT NOT NULL,
    id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    removed_at REAL,
    record_json TEXT NOT NULL,
    PRIMARY KEY (provider, id)
);
CREATE UNIQUE INDEX IF NOT EXISTS volumes_live_name ON volumes(name) WHERE removed_at IS NULL"""
# Data snapshots (`gpuctl data push`), recorded once a push is done; removed ones stay (removed_at)
# for what they cost while they existed. One live snapshot per name.
SNAPSHOTS_TABLE = """
CREATE TABLE IF NOT EXISTS snapshots (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    removed_at REAL,
    record_json TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS snapshots_live_name ON snapshots(name) WHERE removed_at IS NULL"""
SCHEMA = IMAGES_TABLE + ";" + VOLUMES_TABLE + ";" + SNAPSHOTS_TABLE + ";" + BILLED_TABLES + ";" + """
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


def _specs_by_provider(db: sqlite3.Connection) -> None:
    """Version 3 kept every provider's fields in every spec (an ssh cluster's said `market` and
    `region`); a spec now holds its own provider's only (model/specs.py), so the others go."""
    for cid, provider, spec_json in db.execute("SELECT id, provider, spec_json FROM clusters").fetchall():
        spec, keep = json.loads(spec_json), spec_fields(provider)
        db.execute("UPDATE clusters SET spec_json = ? WHERE id = ?",
                   (json.dumps({k: v for k, v in spec.items() if k in keep}), cid))


def upgrade(db: sqlite3.Connection) -> None:
    """Bring the ledger's tables to SCHEMA_VERSION, inside the caller's write transaction (another
    gpuctl may have done it while this one waited for the lock)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    exists = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchone()
    if not exists:
        for statement in filter(str.strip, SCHEMA.split(";")):
            db.execute(statement)
    else:
        if version < 2:
            _migrate_1_to_2(db)
        if version < 3:
            db.execute(IMAGES_TABLE)
        if version < 4:
            _specs_by_provider(db)
        if version < 5:
            for statement in VOLUMES_TABLE.split(";"):
                db.execute(statement)
        if version < 6:
            for statement in SNAPSHOTS_TABLE.split(";"):
                db.execute(statement)
        if version < 7:
            for statement in BILLED_TABLES.split(";"):
                db.execute(statement)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
