"""`status` and `cost` say the same, byte for byte, however they read the ledger (issue 39: fast
reads). Golden outputs, written by the straightforward version before the fast one (every epoch
validated, the ledger read again for each run, json.dumps with indent), of a ledger made here with
everything a report reads: clusters of both billing rules, spot instances with price steps and a
free interruption, several generations of instances, runs cut short and resumed, runs with no
epoch, epochs that say they cost nothing, a stored epoch today's bounds refuse, metric names out
of ASCII and figures across every float magnitude. The clock is held still (time.time).

When a report's output changes on purpose, write the golden files again with
`GPUCTL_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_fast_reads.py` and read the diff.

The JSON writer's own reference test (fast emit_json against json.dumps over awkward values) is
here too: it is what keeps `--json` byte for byte.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import pytest

from gpuctl.ledger import Ledger
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord, Segment
from gpuctl.model.specs import AwsSpec, LocalSpec

GOLDEN = Path(__file__).parent / "golden" / "fast_reads"
WRITE_GOLDEN = bool(os.environ.get("GPUCTL_WRITE_GOLDEN"))  # read before `isolated` drops GPUCTL_*
NOW = 1_790_000_000.0
H = 3600.0
SPOT = "Server.SpotInstanceTermination: Spot instance termination"
REPORTS = {
    "status.txt": ["status"],
    "status.json": ["status", "--json"],
    "cost.txt": ["cost"],
    "cost_all.txt": ["cost", "--all"],
    "cost.json": ["cost", "--json"],
    "cost_runs.json": ["cost", "--json", "r-spot", "r-local-03"],
    "status_run.txt": ["status", "r-spot"],
}


def _epoch(run_id: str, n: int, end: float, seconds: float = 36.0, usd: float | None = None,
           planned: int | None = 6, **extra: object) -> EpochReport:
    return EpochReport.model_validate({
        "schema": 1, "run_id": run_id, "epoch": n, "epochs_planned": planned, "start": end - seconds, "end": end,
        "seconds": seconds, "examples": 50_000 + n, "examples_per_s": (50_000 + n) / seconds if seconds else None, "usd_per_hour": 3.6,
        "epoch_cost_usd": seconds * 3.6 / H if usd is None else usd, "cumulative_usd": n * seconds * 3.6 / H,
        **extra})


def fill(home: Path) -> None:
    """The ledger every golden output was made from (released clusters only: no host is asked)."""
    rnd = random.Random(39)
    led = Ledger(home)
    # A local cluster, released two days ago, with a dozen runs.
    local = led.add_cluster(LocalSpec(name="lab", usd_per_hour=1.5))
    led.put_instance(local.id, InstanceRecord(id="i-lab", cluster="lab", state="terminated", launched_at=NOW - 3 * 86400,
                                              terminated_at=NOW - 2 * 86400, workdir="/w", usd_per_hour=1.5))
    for r in range(12):
        rid = f"r-local-{r:02d}"
        start = NOW - 3 * 86400 + r * 1000
        state = ["succeeded", "failed", "stopped", "succeeded"][r % 4]
        led.put_run(RunRecord(run_id=rid, cluster="lab", cluster_id=local.id, project="/p", entry="train.py",
                              state=state, started_at=start, ended_at=start + 400 + r, usd_per_hour=1.5,
                              run_dir=f"/nowhere/{rid}", epochs_planned=None if r == 5 else 6,
                              exit_code=1 if state == "failed" else 0))
        n_epochs = 0 if r == 7 else (r % 6) + 1
        metrics_of = [
            {"loss": rnd.uniform(0, 3), "accuracy": rnd.random()},
            {"lr": 10 ** rnd.uniform(-9, -3), "big": 10 ** rnd.uniform(14, 20), "count": 7},
            {"précision": 0.5, "損失": 1e-5, "emoji😀": -2.5e-7, "zero": 0.0, "neg": -0.0},
        ]
        led.put_epochs([
            _epoch(rid, n, start + 36 * n, seconds=0.0 if r == 9 else 36.0, usd=0.0 if r == 9 else None, metrics=metrics_of[(r + n) % 3],
                   gpu_util_percent=rnd.uniform(0, 100) if n % 2 else None, gpu_memory_used_mib=1234.5)
            for n in range(1, n_epochs + 1)])
    led.mark_cluster_down(local.id, NOW - 2 * 86400)
    # An AWS cluster billed per second: a spot instance interrupted for free in its first hour, its
    # replacement with price steps, a run cut short on the first and resumed on the second.
    aws = led.add_cluster(AwsSpec(name="gpu", provider="aws", billing="per-second", disk_gb=100))
    t0 = NOW - 86400
    led.put_instance(aws.id, InstanceRecord(id="i-one", cluster="gpu", state="terminated", launched_at=t0,
                                            terminated_at=t0 + 1800, workdir="/w", usd_per_hour=0.5, market="spot",
                                            state_reason=SPOT, on_demand_usd_per_hour=1.2, instance_type="g5.xlarge"))
    led.put_instance(aws.id, InstanceRecord(id="i-two", cluster="gpu", state="terminated", launched_at=t0 + 1900,
                                            terminated_at=t0 + 2 * H, workdir="/w", usd_per_hour=0.6, market="spot",
                                            price_steps=((t0 + 1900, 0.6), (t0 + 4000, 0.45)),
                                            on_demand_usd_per_hour=1.2, instance_type="g5.xlarge"))
    segs = (Segment(instance_id="i-one", market="spot", usd_per_hour=0.5, started_at=t0 + 60, ended_at=t0 + 1800,
                    end="preempted"),
            Segment(instance_id="i-two", market="spot", usd_per_hour=0.6, started_at=t0 + 1960, ended_at=t0 + 5000,
                    end="succeeded"))
    led.put_run(RunRecord(run_id="r-spot", cluster="gpu", cluster_id=aws.id, project="/p", entry="train.py",
                          state="succeeded", started_at=t0 + 60, ended_at=t0 + 5000, usd_per_hour=0.6,
                          run_dir="/nowhere/r-spot", epochs_planned=20, segments=segs, resumes=1))
    led.put_epochs([_epoch("r-spot", n, t0 + 60 + 300 * n, seconds=300.0, planned=20, metrics={"loss": 1 / n})
                    for n in range(1, 5)] +
                   [_epoch("r-spot", n, t0 + 1960 + 300 * (n - 4), seconds=300.0, planned=20,
                           metrics={"loss": 1 / n}) for n in range(5, 15)])
    led.put_run(RunRecord(run_id="r-spot-none", cluster="gpu", cluster_id=aws.id, project="/p", entry="t.py",
                          state="stopped", started_at=t0 + 5100, ended_at=t0 + 6000, usd_per_hour=0.45,
                          run_dir="/nowhere/none", epochs_planned=3))
    led.mark_cluster_down(aws.id, t0 + 2 * H)
    # A stored epoch that today's bounds refuse (a gpuctl before them let it in): left out on reading.
    with led.write() as db:
        bad = _epoch("r-local-00", 2, NOW).model_dump(by_alias=True)
        bad["start"] = 1e308
        db.execute("INSERT OR REPLACE INTO epochs (run_id, epoch, report_json) VALUES (?, ?, ?)",
                   ("r-local-00", 2, json.dumps(bad)))
    led.close()


@pytest.fixture
def still(monkeypatch):
    """The clock held at NOW, in UTC (reports print local times), and a fixed width."""
    monkeypatch.setattr(time, "time", lambda: NOW)
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def outputs(gpuctl, home: Path) -> dict[str, str]:
    fill(home)
    return {name: gpuctl(*argv).stdout for name, argv in REPORTS.items()}


def test_status_and_cost_say_what_the_golden_outputs_say(gpuctl, isolated, still):
    got = outputs(gpuctl, isolated)
    if WRITE_GOLDEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in got.items():
            (GOLDEN / name).write_text(text)
    for name, text in got.items():
        assert text == (GOLDEN / name).read_text(), f"{name} differs from {GOLDEN / name}"


def test_the_ledger_holds_what_the_golden_outputs_need(gpuctl, isolated, still):
    """The fixture's edges are there: a refused epoch, a run without epochs, one cut short and resumed."""
    fill(isolated)
    cost = json.loads(gpuctl("cost", "--json").stdout)
    runs = {r["run_id"]: r for r in cost["runs"]}
    assert [e["epoch"] for e in runs["r-local-00"]["epochs"]] == [1]  # epoch 2 refused by today's bounds
    assert runs["r-local-07"]["spent_from"] == "wall time" and runs["r-local-09"]["spent_from"] == "wall time"
    assert runs["r-spot"]["lost_s"] > 0 and len(runs["r-spot"]["segments"]) == 2
    assert any(not name.isascii() for r in runs.values() for e in r["epochs"] for name in e["metrics"])


# --- the JSON writer -------------------------------------------------------------------------------


def _floats(rnd: random.Random, n: int) -> list[float]:
    edges = [0.0, -0.0, 1e-5, 1e-4, 9.999e-5, 0.0001234, 1e15, 1e16, 9999999999999998.0, 1.5e16, 1e300, 5e-324,
             -2.5e-7, 0.1, 1 / 3, 123456789012345678.0, 2.0 ** 53, -1e-310]
    return edges + [rnd.choice((-1, 1)) * rnd.random() * 10.0 ** rnd.randint(-320, 300) for _ in range(n)]


def test_emit_json_writes_what_json_dumps_with_indent_writes(capsys):
    from gpuctl.cli import render
    from gpuctl.model.results import CostReport, EpochRow, RunCost

    rnd = random.Random(7)
    names = ["loss", "précision", "損失", "emoji😀", "ctl\x01\x1f\x7f", "quote\"back\\slash/", "line\u2028sep",
             "tab\t\n\r\b\f", "<img src=x onerror=alert(1)>", ""]
    floats = _floats(rnd, 3000)
    rows = tuple(EpochRow(epoch=i + 1, seconds=abs(f) if math.isfinite(f) else 1.0, examples=i, examples_per_s=f,
                          epoch_cost_usd=abs(f), cumulative_usd=abs(f), metrics={rnd.choice(names): f, "n": i})
                 for i, f in enumerate(floats))
    run = RunCost(run_id="r-é😀", cluster="c", state="succeeded", usd_per_hour=1e-5, epochs_done=len(rows),
                  epochs=rows, spent_usd=0.0)
    # A lone surrogate (a path of bytes that are not UTF-8, decoded as Python decodes file names)
    # that pydantic's serializer refuses: that part goes the long way.
    odd = run.model_copy(update={"run_id": "r-\udcff", "epochs": rows[:3]})
    report = CostReport(clusters=(), runs=(run, odd, run.model_copy(update={"epochs": ()})), total_usd=0.0,
                        notes=("a note", "ünïcode"))
    render.emit_json(report)
    assert capsys.readouterr().out == json.dumps(report.model_dump(mode="json", by_alias=True), indent=2) + "\n"


def test_the_last_epoch_is_the_last_of_all_epochs_today_s_bounds_accept(isolated):
    """`status` reads a run's last epoch alone; it is what reading them all would end with, also
    where the latest stored row is refused (r-local-00) and where there is none (r-local-07)."""
    fill(isolated)
    led = Ledger(isolated)
    for run in led.runs():
        every = led.epochs(run.run_id)
        assert led.last_epoch(run.run_id) == (every[-1] if every else None), run.run_id
    assert led.last_epoch("r-local-00") is not None and led.last_epoch("no-such-run") is None


def test_cost_without_the_older_runs_rows_says_every_figure_the_same(isolated, still):
    """The plain `cost` table asks for the rows of its newest runs only: every other figure of
    every run is what the full report says (the golden outputs check the table itself)."""
    from gpuctl.ops import costs
    from gpuctl.ops.session import Session

    fill(isolated)
    s = Session(isolated, env={"GPUCTL_PROVIDER": "local", "HOME": str(isolated.parent / "user")})
    full, slim = costs.cost(s), costs.cost(s, rows_of_last=2)
    assert slim.runs[-2:] == full.runs[-2:] and slim.runs[-2].epochs  # r-spot (r-spot-none has none)
    assert slim.runs[:-2] == tuple(r.model_copy(update={"epochs": ()}) for r in full.runs[:-2])
    assert slim.model_copy(update={"runs": full.runs}) == full


def test_epoch_rows_share_their_fields_set_and_a_copy_gets_its_own(isolated, still):
    from gpuctl.model.results import EpochRow
    from gpuctl.ops import costs
    from gpuctl.ops.session import Session

    fill(isolated)
    s = Session(isolated, env={"GPUCTL_PROVIDER": "local", "HOME": str(isolated.parent / "user")})
    rows = [row for run in costs.cost(s).runs for row in run.epochs]
    assert len({id(row.model_fields_set) for row in rows}) == 1 and rows[0].model_fields_set == set(EpochRow.model_fields)
    copy = rows[0].model_copy(update={"epoch": 99})
    assert copy.model_fields_set is not rows[0].model_fields_set and rows[1].epoch != 99
    assert rows[1].model_fields_set == set(EpochRow.model_fields)
