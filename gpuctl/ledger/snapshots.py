"""The ledger's data snapshots (`gpuctl data push`): each recorded once its first push is done,
updated by every later push and by each `train --data gpuctl:NAME` (last used); a removed one
keeps its dates for what it cost. A mixin of Ledger (ledger/__init__.py), which has the
connection and the write transaction."""

from __future__ import annotations

import sqlite3
import time
from contextlib import AbstractContextManager
from typing import Any

from gpuctl.model.snapshots import Snapshot


class SnapshotRows:
    def write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # Ledger's

    def _all(self, query: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError  # Ledger's

    def put_snapshot(self, snapshot: Snapshot) -> None:
        """New (no live one of that name), or the live one of that name as it is now."""
        with self.write() as db:
            updated = db.execute("UPDATE snapshots SET record_json = ? WHERE name = ? AND removed_at IS NULL",
                                 (snapshot.model_dump_json(), snapshot.name)).rowcount
            if not updated:
                db.execute("INSERT INTO snapshots (name, created_at, record_json) VALUES (?, ?, ?)",
                           (snapshot.name, snapshot.created_at, snapshot.model_dump_json()))

    def snapshot_used(self, name: str, at: float | None = None) -> None:
        snapshot = self.snapshot(name)
        if snapshot is not None:
            self.put_snapshot(snapshot.model_copy(update={"last_used_at": at or time.time()}))

    def snapshot_removed(self, name: str, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE snapshots SET removed_at = ? WHERE name = ? AND removed_at IS NULL",
                       (at or time.time(), name))

    def snapshots(self, include_removed: bool = False) -> list[tuple[Snapshot, float | None]]:
        """(snapshot, when it was removed or None), oldest first."""
        where = "" if include_removed else "WHERE removed_at IS NULL"
        rows = self._all(f"SELECT record_json, removed_at FROM snapshots {where} ORDER BY created_at, id")
        return [(Snapshot.model_validate_json(record), removed) for record, removed in rows]

    def snapshot(self, name: str) -> Snapshot | None:
        """The live snapshot of that name."""
        rows = self._all("SELECT record_json FROM snapshots WHERE name = ? AND removed_at IS NULL", (name,))
        return Snapshot.model_validate_json(rows[0][0]) if rows else None
