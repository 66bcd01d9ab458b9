"""The ledger: typed round trips, one live cluster per name, and several processes writing at once."""

import multiprocessing
import sqlite3
import time

import pytest

from gpuctl.state import Ledger
from gpuctl.types import ClusterSpec, EpochReport, InstanceRecord, RunRecord


def spec(name="c1"):
    return ClusterSpec(name=name, provider="local", usd_per_hour=1.5)


def test_round_trip_and_default(tmp_path):
    led = Ledger(tmp_path)
    a = led.add_cluster(spec("a"))
    assert a.is_default and led.default_cluster().name == "a"
    led.add_cluster(spec("b"))
    assert led.default_cluster().name == "b"
    inst = InstanceRecord(id="i-1", cluster="a", state="running", launched_at=1.0, workdir="/w", usd_per_hour=1.5)
    led.put_instance(inst)
    assert led.instances("a") == [inst]
    run = RunRecord(run_id="r1", cluster="a", project="/p", entry="train.py", state="running", started_at=2.0, run_dir="/w/r1")
    led.put_run(run)
    assert led.run("r1") == run and led.runs("a") == [run] and led.runs("b") == []
    rep = EpochReport.model_validate({
        "schema": 1, "run_id": "r1", "epoch": 1, "start": 0, "end": 2, "seconds": 2,
        "usd_per_hour": 3.6, "epoch_cost_usd": 0.002, "cumulative_usd": 0.002,
    })
    led.put_epochs([rep])
    led.put_epochs([rep])  # idempotent
    assert led.epochs("r1") == [rep]
    led.mark_cluster_down("b")
    assert led.default_cluster() is None
    assert [c.state for c in led.clusters()] == ["up", "down"]


def test_one_live_cluster_per_name_but_names_reusable_after_down(tmp_path):
    led = Ledger(tmp_path)
    led.add_cluster(spec("x"))
    with pytest.raises(sqlite3.IntegrityError):
        led.add_cluster(spec("x"))
    led.mark_cluster_down("x")
    led.add_cluster(spec("x"))
    assert [c.state for c in led.clusters()] == ["down", "up"]


def _writer(home, worker, count):
    led = Ledger(home)
    for i in range(count):
        led.event("test", f"{worker}-{i}")
        run = RunRecord(run_id=f"r{worker}-{i}", cluster="shared", project="/p", entry="t.py",
                        state="running", started_at=time.time(), run_dir="/d")
        led.put_run(run)


def test_concurrent_writers_from_several_processes(tmp_path):
    Ledger(tmp_path).add_cluster(spec("shared"))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, 60)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    led = Ledger(tmp_path)
    assert len(led.events()) == 240
    assert len(led.runs()) == 240
    assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
