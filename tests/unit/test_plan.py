"""`gpuctl plan`'s pure parts: the measurement of K epochs, the projection and the ranking, the
bounds on what the instance reports; the payload's GPU sampler and the report API for custom loops
(off gpuctl a no-op; under gpuctl, a report per epoch and the end of the run after K)."""

from __future__ import annotations

import json
import sys

import pytest

from gpuctl.model.records import EpochReport
from gpuctl.model.results import PlanRow
from gpuctl.ops.projection import MAX_SECONDS, Measured, bounded, one_line, project, rank, starved
from gpuctl.payloads import gpuctl_gpu, gpuctl_report


def report(epoch, seconds, examples=1000, util=None, memory=None, start=None):
    start = 1000.0 + 10 * epoch if start is None else start
    return EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": epoch, "start": start, "end": start + seconds, "seconds": seconds,
        "examples": examples, "usd_per_hour": 1.0, "epoch_cost_usd": 0.0, "cumulative_usd": 0.0,
        "gpu_util_percent": util, "gpu_memory_used_mib": memory, "gpu_memory_total_mib": 24000.0 if memory else None})


def test_the_first_epoch_apart_and_the_steady_ones_averaged():
    m = Measured([report(1, 9.0, util=20, memory=1000), report(2, 3.0, util=80, memory=5000),
                  report(3, 5.0, util=60, memory=4000)])
    assert (m.first_s, m.steady_s, m.steady_epochs) == (9.0, 4.0, 2)
    assert m.examples_per_s == pytest.approx(2000 / 8.0)  # the steady epochs only
    assert m.gpu_util_percent == pytest.approx(70)  # the steady epochs only: warm-up is not the pipeline
    assert (m.gpu_memory_used_mib, m.gpu_memory_total_mib) == (5000, 24000)
    one = Measured([report(1, 9.0)])
    assert (one.first_s, one.steady_s, one.steady_epochs) == (9.0, 9.0, 0)


def test_projection_is_ready_plus_first_plus_the_steady_rest():
    seconds, usd = project(ready_s=120.0, first_s=60.0, steady_s=30.0, epochs=50, usd_per_hour=3.6)
    assert seconds == 120 + 60 + 49 * 30 and usd == pytest.approx(seconds * 3.6 / 3600)
    assert project(0, 10, 5, 1, 1.0)[0] == 10  # one epoch: the first alone


def row(label, usd=None, seconds=None, util=None, outcome="ok"):
    return PlanRow(label=label, source="type", cluster=label, provider="aws", projected_usd=usd,
                   projected_s=seconds, gpu_util_percent=util, outcome=outcome)


def test_ranked_by_dollars_fastest_marked_failures_last():
    ranked = rank([row("slow-cheap", 1.0, 900), row("broken", outcome="failed"), row("fast-dear", 2.0, 300),
                   row("mid", 1.5, 600)])
    assert [(r.label, r.rank, r.fastest) for r in ranked] == [
        ("slow-cheap", 1, False), ("mid", 2, False), ("fast-dear", 3, True), ("broken", None, False)]
    assert starved(row("x", util=59.9)) and not starved(row("y", util=60)) and not starved(row("z"))


@pytest.mark.parametrize("value, high, want", [
    (5.0, 10, 5.0), (float("inf"), 10, None), (float("nan"), 10, None), (-1, 10, None), (11, 10, None),
    ("3", 10, 3.0), ("x", 10, None), (True, 10, None), (None, 10, None)])
def test_figures_from_the_instance_are_bounded(value, high, want):
    assert bounded(value, high) == want


def test_a_log_line_shown_is_one_printable_line_cut_to_size():
    assert one_line("first\nTraceback...\nValueError: bad \x1b[31mred\x1b[0m\n\n") == "ValueError: bad ?[31mred?[0m"
    assert len(one_line("x" * 5000)) == 200 and one_line("\n \n") is None and one_line(None) is None


def test_epoch_reports_keep_believable_gpu_figures_and_drop_the_rest():
    assert report(1, 1.0, util=55.5, memory=100).gpu_util_percent == 55.5
    for util in (101, -1, float("inf"), "95", True):
        assert report(1, 1.0, util=util).gpu_util_percent is None  # the epoch itself is kept
    line = json.dumps({"schema": 1, "run_id": "r", "epoch": 1, "start": 0, "end": 1, "seconds": 1,
                       "usd_per_hour": 0, "epoch_cost_usd": 0, "cumulative_usd": 0, "gpu_memory_used_mib": 1e300})
    assert EpochReport.model_validate_json(line).gpu_memory_used_mib is None


# --- the payload: nvidia-smi ---------------------------------------------------------------------


def test_nvidia_smi_lines_parsed_with_bounds():
    assert gpuctl_gpu.parse("90, 1000, 24000\n70, 3000, 24000\n") == (80.0, 4000.0, 48000.0)
    assert gpuctl_gpu.parse("[N/A], 10, 20\nnan, 1, 2\n500, 1, 2\n") is None
    assert gpuctl_gpu.parse("") is None and gpuctl_gpu.parse("garbage") is None
    assert gpuctl_gpu.parse("50, 1e99, 2\n40, 1, 2") == (40.0, 1.0, 2.0)


def test_only_the_runs_gpus_are_asked(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpuctl_gpu.Sampler(1).command[-2:] == ["-i", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-uuid")
    assert "-i" not in gpuctl_gpu.Sampler(1).command


def test_sampler_keeps_readings_and_stops_where_nvidia_smi_is_missing():
    ok = gpuctl_gpu.Sampler(0.05, [sys.executable, "-c", "print('42, 100, 200')"])
    assert ok.sample() == (42.0, 100.0, 200.0)
    t = ok.samples[-1][0]
    assert ok.between(t - 1, t + 1) == {"gpu_util_percent": 42.0, "gpu_memory_used_mib": 100.0,
                                        "gpu_memory_total_mib": 200.0, "gpu_samples": 1}
    assert ok.between(t + 1, t + 2) == {}  # an epoch with no sample in it says nothing
    missing = gpuctl_gpu.Sampler(0.05, ["/nonexistent/nvidia-smi"])
    assert missing.sample() is None and missing.failed


# --- the payload: the report API -----------------------------------------------------------------


@pytest.fixture
def under_gpuctl(tmp_path, monkeypatch):
    """A run directory with its run.json, as the launcher's job sees it."""
    def make(**cfg):
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
        config = {"run_id": "r1", "report_path": str(run_dir / "epochs.jsonl"), "usd_per_hour": 3.6, **cfg}
        (run_dir / "run.json").write_text(json.dumps(config))
        monkeypatch.setenv("GPUCTL_RUN_DIR", str(run_dir))
        monkeypatch.setattr(gpuctl_report.ReportWriter, "_by_path", {})
        monkeypatch.setitem(gpuctl_report.STATE, "enough", False)
        return run_dir / "epochs.jsonl"
    return make


def test_off_gpuctl_the_api_does_nothing(monkeypatch):
    monkeypatch.delenv("GPUCTL_RUN_DIR", raising=False)
    with gpuctl_report.epoch(examples=10) as e:
        e.metrics(loss=1.0)
    assert e.report is None and gpuctl_report.report_epoch(seconds=1.0) is None


def test_a_custom_loop_reports_each_epoch_and_ends_after_the_probe_epochs(under_gpuctl):
    path = under_gpuctl(stop_after_epochs=2)
    with gpuctl_report.epoch(examples=500, planned=10) as e:
        e.metrics(loss=0.5)
    with pytest.raises(gpuctl_report.EnoughEpochs) as ended:
        with gpuctl_report.epoch(examples=500) as e:
            e.metrics(loss=0.25, accuracy=0.9)
    assert ended.value.code == 0  # the run succeeded: it did what it was asked
    lines = [EpochReport.model_validate_json(line) for line in path.read_text().splitlines()]
    assert [(r.epoch, r.examples, r.epochs_planned) for r in lines] == [(1, 500, 10), (2, 500, None)]
    assert lines[1].metrics == {"accuracy": 0.9, "loss": 0.25} and lines[0].examples_per_s > 0


def test_an_epoch_that_raised_is_not_reported(under_gpuctl):
    path = under_gpuctl()
    with pytest.raises(ValueError):
        with gpuctl_report.epoch(examples=5):
            raise ValueError("diverged")
    assert not path.exists()
    import numpy as np

    r = gpuctl_report.report_epoch(start=10.0, end=12.0, examples=np.int64(64), metrics={"loss": np.float32(1.5)})
    assert (r["seconds"], r["examples"], r["metrics"]) == (2.0, 64, {"loss": 1.5})


def test_the_budget_ends_a_custom_loop_too(under_gpuctl):
    under_gpuctl(usd_per_hour=3600.0, budget_usd=2.5)
    gpuctl_report.report_epoch(start=0.0, end=1.0)  # $1: the next would make $2
    with pytest.raises(gpuctl_report.EnoughEpochs):
        gpuctl_report.report_epoch(start=1.0, end=2.0)  # $2: the next would cross $2.5


# --- what the user sees ---------------------------------------------------------------------------


def sample_report():

    ok = dict(source="type", provider="aws", market="spot", ready_s=200.0, first_epoch_s=90.0, steady_epoch_s=30.0,
              steady_epochs=1, examples_per_s=1500.0, gpu_memory_used_mib=9000.0, gpu_memory_total_mib=23028.0)
    rows = [
        PlanRow(label="g6.xlarge spot", cluster="plan-1a2b-g6-xlarge", instance_type="g6.xlarge", usd_per_hour=0.35,
                gpu_util_percent=41.0, projected_s=1760.0, projected_usd=0.171, **ok),
        PlanRow(label="g5.xlarge spot", cluster="plan-1a2b-g5-xlarge", instance_type="g5.xlarge", usd_per_hour=0.45,
                gpu_util_percent=92.0, projected_s=1100.0, projected_usd=0.1375, **ok),
        PlanRow(label="g4dn.xlarge spot", cluster="plan-1a2b-g4dn-xlarge", source="type", provider="aws",
                outcome="failed", problem="RuntimeError: CUDA error: out of memory"),
    ]
    from pathlib import Path

    from gpuctl.ops.plan import report
    from gpuctl.ops.probes import ProbeJob

    job = ProbeJob(project=Path("/p/proj"), args=("--lr", "3e-4"), data=None, allow_cpu=False, probe_epochs=2,
                   epochs=50, timeout_s=1800)
    return report(job, rows, worst_case_usd=2.4)


def test_the_report_ranks_hints_and_recommends():
    r = sample_report()
    assert [(x.label, x.rank, x.fastest) for x in r.rows] == [
        ("g5.xlarge spot", 1, True), ("g6.xlarge spot", 2, False), ("g4dn.xlarge spot", None, False)]
    assert r.recommendation == "gpuctl up --type g5.xlarge --spot && gpuctl train /p/proj -- --lr 3e-4"
    (hint,) = r.notes
    assert hint.startswith("g6.xlarge spot: the GPU was busy 41%") and "prefetch" in hint


def test_the_table_keeps_money_and_machines_whole_at_80_columns():
    import io

    from rich.console import Console

    from gpuctl.cli.render import plan as render_plan

    buf = io.StringIO()
    render_plan.plan(sample_report(), out=Console(file=buf, width=80, highlight=False, color_system=None))
    out = buf.getvalue()
    assert "$0.1375" in out and "g5.xlarge spot" in out and "fastest" in out
    assert "g4dn.xlarge spot: failed: RuntimeError: CUDA error: out of memory" in out
    assert "Hint: g6.xlarge spot: the GPU was busy 41%" in out
    assert "Cheapest for 50 epochs: g5.xlarge spot, $0.1375 in 18m20s" in out
    assert "This plan cost $0.0000 (worst case was $2.4000)" in out
    assert all(len(line) <= 80 for line in out.splitlines() if "  " in line and "$" in line)


def test_the_plan_plot_draws_one_point_per_machine(tmp_path):
    pytest.importorskip("matplotlib")
    from gpuctl.cli.render.plot import plan_plot

    path = tmp_path / "plan.png"
    assert plan_plot(sample_report(), path) == 2
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- what a review of the plan found (each seen failing before its fix) --------------------------


def test_epochs_of_no_believable_time_are_no_reading_and_never_ranked():
    """0 s epochs (a report with no timing) or ones over a week (a hostile instance) used to count
    as 0 s: that machine projected only its ready time and ranked cheapest and fastest."""
    from pathlib import Path

    from gpuctl.ops import plan
    from gpuctl.ops.probes import ProbeJob, figures

    honest = figures(PlanRow(label="honest", source="type", cluster="a", provider="aws", usd_per_hour=1.0),
                     Measured([report(1, 60.0), report(2, 30.0)]), 100.0, 50)
    rows = [honest]
    for label, seconds in (("zero", 0.0), ("eight days", 8 * 86400.0)):
        r = figures(PlanRow(label=label, source="type", cluster=label, provider="aws", usd_per_hour=5.0),
                    Measured([report(1, seconds), report(2, seconds)]), 10.0, 50)
        assert r.outcome == "no reading" and r.projected_usd is None and "no believable time" in r.problem
        rows.append(r)
    job = ProbeJob(project=Path("/p"), args=(), data=None, allow_cpu=False, probe_epochs=2, epochs=50, timeout_s=60)
    ranked = plan.report(job, rows).rows
    assert [(r.label, r.rank, r.fastest) for r in ranked] == [
        ("honest", 1, True), ("zero", None, False), ("eight days", None, False)]


def test_an_epoch_reported_without_timing_is_the_time_since_the_previous_one(under_gpuctl, monkeypatch):
    under_gpuctl()
    monkeypatch.setattr(gpuctl_report, "LOADED_AT", 1000.0)
    clock = iter([1012.0, 1019.5])
    monkeypatch.setattr(gpuctl_report.time, "time", lambda: next(clock))
    first = gpuctl_report.report_epoch(examples=10)
    second = gpuctl_report.report_epoch(examples=10)
    assert (first["start"], first["seconds"]) == (1000.0, 12.0)  # since the script started
    assert (second["start"], second["seconds"]) == (1012.0, 7.5)  # since the previous report


def test_the_recommendation_keeps_the_probes_data_and_allow_cpu():
    from pathlib import Path

    from gpuctl.ops.plan import _command
    from gpuctl.ops.probes import ProbeJob

    job = ProbeJob(project=Path("/p/proj"), args=("--lr", "3e-4"), data=Path("/data/set"), allow_cpu=True,
                   probe_epochs=2, epochs=50, timeout_s=60)
    r = PlanRow(label="g5.xlarge spot", source="type", cluster="c", provider="aws", instance_type="g5.xlarge",
                market="spot")
    assert _command(r, job) == ("gpuctl up --type g5.xlarge --spot && "
                                "gpuctl train /p/proj --data /data/set --allow-cpu -- --lr 3e-4")


def test_a_spot_request_that_fell_back_to_on_demand_is_shown_as_on_demand():
    from gpuctl.model.records import InstanceRecord
    from gpuctl.ops.probes import _as_launched

    r = PlanRow(label="g5.xlarge spot", source="type", cluster="c", provider="aws", instance_type="g5.xlarge",
                market="spot")
    inst = InstanceRecord(id="i-1", cluster="c", state="running", market="on-demand", launched_at=0.0, workdir="/w")
    assert (_as_launched(r, [inst]).label, _as_launched(r, [inst]).market) == ("g5.xlarge on-demand", "on-demand")
    assert _as_launched(r, [inst.model_copy(update={"market": "spot"})]) == r


def test_a_probe_cluster_left_billing_or_nothing_measured_exits_non_zero():
    from gpuctl.errors import CloudError, RunFailedError
    from gpuctl.model.results import PlanReport
    from gpuctl.ops.plan import raise_for

    measured = PlanRow(label="a", source="type", cluster="a", provider="aws", projected_usd=1.0, rank=1)
    left = PlanRow(label="b", source="type", cluster="plan-1-b", provider="aws", outcome="failed", released=False)
    raise_for(PlanReport(project="/p", epochs=5, probe_epochs=2, rows=(measured,)))  # all well: nothing raised
    with pytest.raises(CloudError, match="plan-1-b") as err:
        raise_for(PlanReport(project="/p", epochs=5, probe_epochs=2, rows=(measured, left)))
    assert "gpuctl down plan-1-b -y" in err.value.hint
    with pytest.raises(RunFailedError, match="no machine was measured"):
        raise_for(PlanReport(project="/p", epochs=5, probe_epochs=2, rows=(left.model_copy(update={"released": True}),)))


# The edges the tests above leave open (found by scripts/mutate: each row is a mutant it survived).
@pytest.mark.parametrize("value, want", [
    (0.0, 0.0), (0.5, 0.5),  # a zero-second figure is a reading, not a missing one
    (MAX_SECONDS, MAX_SECONDS), (MAX_SECONDS + 1, None)])
def test_bounded_keeps_both_ends_of_its_range(value, want):
    assert bounded(value) == want


def test_one_line_keeps_a_line_of_exactly_the_limit_whole():
    assert one_line("x" * 10, limit=10) == "x" * 10
    assert one_line("x" * 11, limit=10) == "xxxxxxx..."


@pytest.mark.parametrize("epochs, n, first, steady_epochs", [
    ([], 0, None, 0),  # no report: nothing measured, and no error
    ([report(1, 9.0)], 1, 9.0, 0),
    ([report(1, 9.0), report(2, 3.0)], 2, 9.0, 1),
])
def test_measured_counts_its_epochs(epochs, n, first, steady_epochs):
    m = Measured(epochs)
    assert (m.epochs, m.first_s, m.steady_epochs) == (n, first, steady_epochs)


def test_examples_per_second_counts_only_epochs_that_said_their_examples():
    m = Measured([report(1, 9.0), report(2, 10.0, examples=100), report(3, 10.0, examples=None)])
    assert m.examples_per_s == pytest.approx(10.0)


@pytest.mark.parametrize("examples, seconds, want", [
    (3_000_000, 2.0, 1_500_000.0),  # fast: far above a time's bound, still a reading
    (2 * 10**12 + 1, 2.0, None),  # above 10^12 examples/s: no reading
])
def test_examples_per_second_is_bounded_by_its_own_range(examples, seconds, want):
    m = Measured([report(1, 9.0), report(2, seconds, examples=examples)])
    assert m.examples_per_s == want


def test_rank_breaks_a_dollar_tie_by_time_and_reads_no_time_as_zero():
    ranked = rank([row("slow", 1.0, 900), row("fast", 1.0, 300)])
    assert [(r.label, r.fastest) for r in ranked] == [("fast", True), ("slow", False)]
    unknown = rank([row("half", 1.0, 0.5), row("no-time", 1.0, None)])
    assert [(r.label, r.fastest) for r in unknown] == [("no-time", True), ("half", False)]
    assert rank([row("broken", outcome="failed")])[0].rank is None  # nothing measured: nothing ranked
