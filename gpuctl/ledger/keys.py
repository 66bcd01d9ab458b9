"""What changes when a run does, read in two queries without validating a record: the
dashboard's looks compare these and rebuild only the runs whose key moved (ops/dashboard.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuctl.ledger import Ledger

# run id -> (its cluster id, its record as stored, its epochs: how many, the last). An epoch
# rewritten in place (same number) leaves the key as it was: that happens when a run is resumed
# or recovered, which writes its record too.
RunKey = tuple[int, str, int, int]


def run_keys(ledger: Ledger) -> dict[str, RunKey]:
    """Every run's key, in the ledger's order (the order `status` lists them)."""
    # count and max over the (run_id, epoch) primary key: the index alone, no report is read.
    epochs = {rid: (n, last) for rid, n, last in ledger._all(
        "SELECT run_id, count(*), max(epoch) FROM epochs GROUP BY run_id")}
    return {rid: (cid, record, *epochs.get(rid, (0, 0)))
            for rid, cid, record in ledger._all("SELECT run_id, cluster_id, record_json FROM runs ORDER BY rowid")}
