"""The run cost projection: mean epoch cost x planned epochs."""

import pytest

from gpuctl.model.records import EpochReport, RunRecord
from gpuctl.ops.costs import run_cost


def report(epoch, seconds, rate=3.6, cumulative=0.0, planned=10):
    return EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": epoch, "epochs_planned": planned, "start": 0, "end": seconds,
        "seconds": seconds, "examples": 100, "examples_per_s": 100 / seconds, "usd_per_hour": rate,
        "epoch_cost_usd": seconds * rate / 3600, "cumulative_usd": cumulative,
    })


def run(**kw):
    base = dict(run_id="r", cluster="c", project="/p", entry="train.py", state="running", started_at=0.0,
                run_dir="/d", usd_per_hour=3.6)
    base.update(kw)
    return RunRecord(**base)


def test_projection_is_mean_epoch_cost_times_planned():
    c = run_cost(run(), [report(1, 10.0), report(2, 20.0)])
    assert c.epochs_done == 2 and c.epochs_planned == 10
    assert c.spent_usd == pytest.approx(0.03)
    assert c.mean_epoch_usd == pytest.approx(0.015)
    assert c.projected_total_usd == pytest.approx(0.15)
    assert c.projected_remaining_usd == pytest.approx(0.12)
    assert c.mean_epoch_s == pytest.approx(15.0)


def test_no_epochs_means_no_projection():
    c = run_cost(run(epochs_planned=5), [])
    assert c.epochs_planned == 5 and c.projected_total_usd is None and c.spent_usd == 0


def test_finished_run_projects_its_actual_total():
    c = run_cost(run(state="succeeded"), [report(1, 10.0, planned=2), report(2, 30.0, planned=2)])
    assert c.projected_total_usd == pytest.approx(c.spent_usd) and c.projected_remaining_usd == 0


def test_a_report_cannot_make_an_epoch_free():
    """The instance is untrusted: an epoch it says cost $0 (or ran 0 s but 60 s by its own times)
    costs its time at the run's rate, and so does the projection."""
    free = EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": 1, "epochs_planned": 10, "start": 0, "end": 60, "seconds": 0,
        "examples": 100, "usd_per_hour": 0, "epoch_cost_usd": 0, "cumulative_usd": 0})
    c = run_cost(run(), [free, report(2, 60.0, rate=0.0)])
    assert [e.epoch_cost_usd for e in c.epochs] == [pytest.approx(0.06), pytest.approx(0.06)]
    assert c.epochs[-1].cumulative_usd == pytest.approx(0.12)
    assert c.projected_total_usd == pytest.approx(0.6)
