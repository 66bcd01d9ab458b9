"""The bill as Cost Explorer answered it (`gpuctl cost --billed`), kept: each request costs $0.01,
so a day asked once is answered from here (a settled day for good, a recent one for a while). A
mixin of Ledger (ledger/__init__.py), which has the connection and the write transaction."""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # model.bill's 11 models are built only where a bill is read (not by `status`)
    from gpuctl.model.bill import BilledRow


class BilledRows:
    def write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # Ledger's

    def _all(self, query: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError  # Ledger's

    def put_billed(self, days: list[str], rows: list[BilledRow], asked_at: float) -> None:
        """Cost Explorer's answer for these days (every day asked, with rows or none) replaces
        what was kept for them."""
        with self.write() as db:
            for day in days:
                db.execute("DELETE FROM billed WHERE day = ?", (day,))
                db.execute("INSERT OR REPLACE INTO billed_days (day, asked_at) VALUES (?, ?)", (day, asked_at))
            for r in rows:
                if r.day in days:
                    db.execute("INSERT OR REPLACE INTO billed (day, cluster, service, usd, estimated)"
                               " VALUES (?, ?, ?, ?, ?)", (r.day, r.cluster, r.service, r.usd, int(r.estimated)))

    def billed_days(self, start: str, end: str) -> dict[str, float]:
        """The days in [start, end) answered before, and when they were asked."""
        return dict(self._all("SELECT day, asked_at FROM billed_days WHERE day >= ? AND day < ?", (start, end)))

    def billed(self, start: str, end: str) -> list[BilledRow]:
        from gpuctl.model.bill import BilledRow

        rows = self._all("SELECT day, cluster, service, usd, estimated FROM billed WHERE day >= ? AND day < ?"
                         " ORDER BY day, cluster, service", (start, end))
        return [BilledRow(day=d, cluster=c, service=s, usd=u, estimated=bool(e)) for d, c, s, u, e in rows]
