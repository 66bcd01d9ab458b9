"""The ledger: typed round trips, one live cluster per name, clusters told apart by id when a name
is used again, the upgrade of a version-1 ledger, and several processes writing at once."""

import json
import multiprocessing
import sqlite3
import time

import pytest

from gpuctl.errors import ConfigError, ConflictError
from gpuctl.ledger import Ledger
from gpuctl.ledger.schema import SCHEMA_VERSION
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord
from gpuctl.model.specs import AwsSpec, ClusterSpec, LocalSpec, SshSpec


def spec(name="c1"):
    return LocalSpec(name=name, usd_per_hour=1.5)


def test_round_trip_and_default(tmp_path):
    led = Ledger(tmp_path)
    a = led.add_cluster(spec("a"))
    assert a.is_default and led.default_cluster().name == "a"
    b = led.add_cluster(spec("b"))
    assert led.default_cluster().name == "b"
    inst = InstanceRecord(id="i-1", cluster="a", state="running", launched_at=1.0, workdir="/w", usd_per_hour=1.5)
    led.put_instance(a.id, inst)
    assert led.instances(a.id) == [inst]
    run = RunRecord(run_id="r1", cluster="a", cluster_id=a.id, project="/p", entry="train.py", state="running",
                    started_at=2.0, run_dir="/w/r1")
    led.put_run(run)
    assert led.run("r1") == run and led.runs(a.id) == [run] and led.runs(b.id) == []
    rep = EpochReport.model_validate({
        "schema": 1, "run_id": "r1", "epoch": 1, "start": 0, "end": 2, "seconds": 2,
        "usd_per_hour": 3.6, "epoch_cost_usd": 0.002, "cumulative_usd": 0.002,
    })
    led.put_epochs([rep])
    led.put_epochs([rep])  # idempotent
    assert led.epochs("r1") == [rep]
    led.mark_cluster_down(b.id)
    assert led.default_cluster() is None
    assert [c.state for c in led.clusters()] == ["up", "down"]


def test_one_live_cluster_per_name_but_names_reusable_after_down(tmp_path):
    led = Ledger(tmp_path)
    first = led.add_cluster(spec("x"))
    with pytest.raises(sqlite3.IntegrityError):
        led.add_cluster(spec("x"))
    led.mark_cluster_down(first.id)
    second = led.add_cluster(spec("x"))
    assert [c.state for c in led.clusters()] == ["down", "up"]
    # Same name, two identities: what hangs off one never shows under the other, even an owned
    # ssh host's instance id, which is the same for both.
    same = InstanceRecord(id="ssh:root@h:22", cluster="x", state="running", launched_at=1.0, workdir="/w")
    led.put_instance(first.id, same)
    led.put_instance(second.id, same.model_copy(update={"launched_at": 5.0}))
    assert [i.launched_at for i in led.instances(first.id)] == [1.0]
    assert [i.launched_at for i in led.instances(second.id)] == [5.0]


def test_a_failed_up_is_forgotten_but_a_cluster_with_runs_is_not(tmp_path):
    led = Ledger(tmp_path)
    c = led.add_cluster(spec("typo"))
    led.event("up", "tried", cluster=c)
    led.forget_cluster(c.id)
    assert led.clusters() == [] and led.events() == []
    kept = led.add_cluster(spec("used"))
    led.put_run(RunRecord(run_id="r", cluster="used", cluster_id=kept.id, project="/p", entry="t.py",
                          state="running", started_at=1.0, run_dir="/d"))
    with pytest.raises(ValueError):
        led.forget_cluster(kept.id)


V1_SCHEMA = """
CREATE TABLE clusters (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, provider TEXT NOT NULL,
    state TEXT NOT NULL, created_at REAL NOT NULL, terminated_at REAL, is_default INTEGER NOT NULL DEFAULT 0,
    spec_json TEXT NOT NULL);
CREATE UNIQUE INDEX clusters_live_name ON clusters(name) WHERE state = 'up';
CREATE TABLE instances (id TEXT PRIMARY KEY, cluster_id INTEGER NOT NULL REFERENCES clusters(id), record_json TEXT NOT NULL);
CREATE TABLE runs (run_id TEXT PRIMARY KEY, cluster_id INTEGER NOT NULL REFERENCES clusters(id), record_json TEXT NOT NULL);
CREATE TABLE epochs (run_id TEXT NOT NULL REFERENCES runs(run_id), epoch INTEGER NOT NULL, report_json TEXT NOT NULL,
    PRIMARY KEY (run_id, epoch));
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, cluster TEXT, run_id TEXT,
    kind TEXT NOT NULL, message TEXT NOT NULL);
"""


def test_a_version_1_ledger_is_upgraded_in_place(tmp_path):
    db = sqlite3.connect(tmp_path / "ledger.sqlite3")
    db.executescript(V1_SCHEMA)
    aws_spec = '{"name": "gpu", "provider": "aws", "instance_type": "g5.xlarge", "disk_gb": 100}'
    db.execute("INSERT INTO clusters VALUES (1, 'gpu', 'aws', 'down', 1.0, 9.0, 0, ?)", (aws_spec,))
    inst = InstanceRecord(id="i-1", cluster="gpu", state="terminated", launched_at=1.0, workdir="/w")
    db.execute("INSERT INTO instances VALUES ('i-1', 1, ?)", (inst.model_dump_json(),))
    # Version 1 run records carry no cluster id: the column says which cluster.
    old_run = '{"run_id": "r", "cluster": "gpu", "project": "/p", "entry": "t.py", "state": "succeeded", ' \
              '"started_at": 1.0, "run_dir": "/d"}'
    db.execute("INSERT INTO runs VALUES ('r', 1, ?)", (old_run,))
    db.execute("INSERT INTO events (ts, cluster, kind, message) VALUES (1.0, 'gpu', 'up', 'x')")
    # The name used again later: its events stay with the cluster that existed when they happened.
    db.execute("INSERT INTO clusters VALUES (2, 'gpu', 'aws', 'up', 20.0, NULL, 1, ?)", (aws_spec,))
    db.execute("INSERT INTO events (ts, cluster, kind, message) VALUES (21.0, 'gpu', 'up', 'y')")
    db.commit()
    db.close()
    led = Ledger(tmp_path)
    c, _ = led.clusters()
    assert c.id == 1 and c.spec.billing == "per-second"  # aws clusters were priced by EC2's rules
    assert c.spec.version == 1  # what it lacks is filled from the settings when it is used
    assert led.instances(1) == [inst]
    assert led.run("r").cluster_id == 1
    assert [e[4] for e in led.events(1)] == ["x"] and [e[4] for e in led.events(2)] == ["y"]
    Ledger(tmp_path)  # opening it again changes nothing
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert led.images() == []  # and the images table of version 3 is there
    assert isinstance(c.spec, AwsSpec) and c.spec.disk_gb == 100  # an aws spec, read as one


def test_a_version_3_ledger_keeps_each_spec_to_its_own_providers_fields(tmp_path):
    """Version 3 wrote every provider's fields into every spec (an ssh cluster's said `market`):
    the upgrade keeps each spec's own, so it reads back as its provider's class; a provider
    gpuctl does not know (a test's) keeps the common fields."""
    Ledger(tmp_path)  # a ledger of today's tables
    common = {"name": "x", "instance_type": "t", "nodes": 1, "usd_per_hour": 2.0, "launch_token": "k", "tensorflow": "2.21",
              "max_hours": 8.0, "launched_for": "", "billing": "hourly-rate", "version": 2}
    aws_only = {"market": "spot", "region": "eu-west-1", "disk_gb": 100, "ssh_cidr": "1.2.3.4/32", "store_id": "ab"}
    ssh_only = {"hosts": ["me@box"], "identity": None}
    db = sqlite3.connect(tmp_path / "ledger.sqlite3")
    for cid, (provider, name) in enumerate([("aws", "a"), ("ssh", "s"), ("local", "l"), ("fake", "f")], start=1):
        spec = {**common, **aws_only, **ssh_only, "name": name, "provider": provider}
        db.execute("INSERT INTO clusters VALUES (?, ?, ?, 'up', 1.0, NULL, 0, ?)", (cid, name, provider, json.dumps(spec)))
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    led = Ledger(tmp_path)
    a, s, loc, fake = led.clusters()
    assert type(a.spec) is AwsSpec and a.spec.interruptible and a.spec.store_place == "a.ab" and a.spec.scope == "eu-west-1"
    assert type(s.spec) is SshSpec and s.spec.hosts == ("me@box",) and not s.spec.interruptible and s.spec.scope is None
    assert type(loc.spec) is LocalSpec and loc.spec.usd_per_hour == 2.0 and loc.spec.tensorflow == "2.21"
    assert type(fake.spec) is ClusterSpec and fake.spec.launch_token == "k"
    stored = json.loads(led._db.execute("SELECT spec_json FROM clusters WHERE name = 'l'").fetchone()[0])
    assert not (set(aws_only) | set(ssh_only)) & set(stored)
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_ledger_from_a_newer_gpuctl_is_refused_not_rewritten(tmp_path):
    Ledger(tmp_path)._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(ConfigError, match="newer gpuctl"):
        Ledger(tmp_path)
    db = sqlite3.connect(tmp_path / "ledger.sqlite3")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1


def test_a_version_4_ledger_gets_the_volumes_table_and_keeps_its_clusters(tmp_path):
    from gpuctl.model.volumes import Volume

    led = Ledger(tmp_path)
    led.add_cluster(LocalSpec(name="old"))
    led._db.execute("DROP TABLE volumes")
    led._db.execute("PRAGMA user_version = 4")
    led.close()
    led = Ledger(tmp_path)
    assert [c.name for c in led.clusters()] == ["old"] and led.volumes() == []
    led.put_volume(Volume(name="data", provider="local", id="/v/data", size_gb=1, created_at=1.0))
    with pytest.raises(ConflictError, match="a volume named 'data' exists already"):
        led.put_volume(Volume(name="data", provider="local", id="/v/other", size_gb=1, created_at=2.0))
    led.volume_removed("local", "/v/data")
    led.put_volume(Volume(name="data", provider="local", id="/v/other", size_gb=1, created_at=2.0))  # the name is free again
    assert [v.id for v, _ in led.volumes(include_removed=True)] == ["/v/data", "/v/other"]
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7


def test_a_version_5_ledger_gets_the_snapshots_table_and_keeps_its_volumes(tmp_path):
    from gpuctl.model.snapshots import Snapshot
    from gpuctl.model.volumes import Volume

    led = Ledger(tmp_path)
    led.put_volume(Volume(name="data", provider="local", id="/v/data", size_gb=1, created_at=1.0))
    led._db.execute("DROP TABLE snapshots")
    led._db.execute("PRAGMA user_version = 5")
    led.close()
    led = Ledger(tmp_path)
    assert [v.name for v, _ in led.volumes()] == ["data"] and led.snapshots() == []
    snap = Snapshot(name="cifar", region="us-east-1", bucket="gpuctl-b", files=2, bytes=10, created_at=1.0, pushed_at=1.0)
    led.put_snapshot(snap)
    led.put_snapshot(snap.model_copy(update={"files": 3, "pushed_at": 2.0}))  # a later push: the same one
    led.snapshot_used("cifar", at=3.0)
    assert [(v.files, v.last_used_at) for v, _ in led.snapshots()] == [(3, 3.0)]
    led.snapshot_removed("cifar", at=4.0)
    assert led.snapshot("cifar") is None and [r for _, r in led.snapshots(include_removed=True)] == [4.0]
    led.put_snapshot(snap)  # the name is free again
    assert len(led.snapshots(include_removed=True)) == 2 and led.snapshot("cifar") == snap
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def _writer(home, worker, count):
    led = Ledger(home)
    for i in range(count):
        led.event("test", f"{worker}-{i}")
        run = RunRecord(run_id=f"r{worker}-{i}", cluster="shared", cluster_id=1, project="/p", entry="t.py",
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


def test_a_version_6_ledger_gets_the_bill_tables_and_keeps_its_clusters(tmp_path):
    from gpuctl.model.bill import BilledRow

    led = Ledger(tmp_path)
    led.add_cluster(LocalSpec(name="old"))
    led._db.execute("DROP TABLE billed")
    led._db.execute("DROP TABLE billed_days")
    led._db.execute("PRAGMA user_version = 6")
    led.close()
    led = Ledger(tmp_path)
    assert [c.name for c in led.clusters()] == ["old"] and led.billed("2026-01-01", "2027-01-01") == []
    row = BilledRow(day="2026-11-02", cluster="a", service="EC2 - Other", usd=0.5)
    led.put_billed(["2026-11-01", "2026-11-02"], [row], asked_at=10.0)
    assert led.billed_days("2026-11-01", "2026-11-03") == {"2026-11-01": 10.0, "2026-11-02": 10.0}
    led.put_billed(["2026-11-02"], [], asked_at=20.0)  # asked again: the day's answer replaced, now no rows
    assert led.billed("2026-11-01", "2026-11-03") == [] and led.billed_days("2026-11-02", "2026-11-03") == {"2026-11-02": 20.0}
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
