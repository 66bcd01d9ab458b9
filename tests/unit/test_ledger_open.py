"""Many connections opening a new ledger at once (the first command of a home, `plan` opening a
session per probe thread): every one of them opens it."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from gpuctl.ledger import Ledger
from gpuctl.model.records import InstanceRecord
from gpuctl.model.specs import LocalSpec

THREADS = 6
ROUNDS = 60


def test_threads_opening_a_new_ledger_together_all_open_it(tmp_path: Path) -> None:
    failed: list[str] = []
    for n in range(ROUNDS):
        home = tmp_path / f"home-{n}"
        together = threading.Barrier(THREADS)

        def open_and_write(home: Path = home, together: threading.Barrier = together) -> None:
            together.wait()
            try:
                led = Ledger(home)
                led.event("opened", "by a thread")
                led.close()
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                failed.append(repr(exc))

        threads = [threading.Thread(target=open_and_write) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failed == []
    led = Ledger(tmp_path / "home-0")
    assert len(led.events()) == THREADS
    assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_read_that_fails_half_way_leaves_no_snapshot_holding_the_next_write(tmp_path: Path) -> None:
    """An instance record that no longer parses raises out of `instances()`; the command that
    catches it (and keeps the error) must still write after another gpuctl did."""
    led = Ledger(tmp_path)
    cluster = led.add_cluster(LocalSpec(name="c", usd_per_hour=1.0))
    for n in range(3):
        led.put_instance(cluster.id, InstanceRecord(id=f"i-{n}", cluster="c", state="running", launched_at=0.0,
                                                    workdir="/w", usd_per_hour=1.0))
    other = sqlite3.connect(tmp_path / "ledger.sqlite3", isolation_level=None)
    other.execute("UPDATE instances SET record_json = '{}' WHERE id = 'i-1'")
    with pytest.raises(ValueError) as kept:  # the traceback (and the reader's frame) stays alive
        led.instances(cluster.id)
    other.execute("INSERT INTO events (ts, kind, message) VALUES (1, 'k', 'another gpuctl')")
    led.event("after", "the failed read")
    assert [e[3] for e in led.events()] == ["k", "after"] and kept.value is not None
