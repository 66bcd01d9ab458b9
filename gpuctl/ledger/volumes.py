"""The ledger's volumes (`gpuctl volume`): each recorded from the moment its provider gave an id,
so a `volume create` killed after EC2 answered still shows in `volume ls` and `cost`; a removed
one keeps its dates for what it cost. A mixin of Ledger (ledger/__init__.py), which has the
connection and the write transaction."""

from __future__ import annotations

import sqlite3
import time
from contextlib import AbstractContextManager
from typing import Any

from gpuctl.errors import ConflictError
from gpuctl.model.volumes import Volume


class VolumeRows:
    def write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # Ledger's

    def _all(self, query: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError  # Ledger's

    def put_volume(self, volume: Volume) -> None:
        """New, or as its provider describes it now (size, state, what it is attached to)."""
        try:
            with self.write() as db:
                db.execute("INSERT INTO volumes (provider, id, name, created_at, record_json) VALUES (?, ?, ?, ?, ?)"
                           " ON CONFLICT(provider, id) DO UPDATE SET record_json = excluded.record_json",
                           (volume.provider, volume.id, volume.name, volume.created_at, volume.model_dump_json()))
        except sqlite3.IntegrityError:
            raise ConflictError(f"a volume named {volume.name!r} exists already",
                                "Pick another name, or `gpuctl volume ls` to see it.") from None

    def volume_removed(self, provider: str, volume_id: str, at: float | None = None) -> None:
        with self.write() as db:
            db.execute("UPDATE volumes SET removed_at = ? WHERE provider = ? AND id = ? AND removed_at IS NULL",
                       (at or time.time(), provider, volume_id))

    def volumes(self, include_removed: bool = False) -> list[tuple[Volume, float | None]]:
        """(volume, when it was removed or None), oldest first."""
        where = "" if include_removed else "WHERE removed_at IS NULL"
        rows = self._all(f"SELECT record_json, removed_at FROM volumes {where} ORDER BY created_at, id")
        return [(Volume.model_validate_json(record), removed) for record, removed in rows]

    def volume(self, name: str) -> Volume | None:
        """The live volume of that name."""
        rows = self._all("SELECT record_json FROM volumes WHERE name = ? AND removed_at IS NULL", (name,))
        return Volume.model_validate_json(rows[0][0]) if rows else None
