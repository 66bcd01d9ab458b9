"""The run cost projection: mean epoch cost x planned epochs."""

import time

import pytest

from gpuctl.errors import ConfigError
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord, Segment
from gpuctl.model.requests import UpRequest
from gpuctl.model.specs import AwsSpec, ClusterSpec
from gpuctl.ops import clusters, costs
from gpuctl.ops.costs import run_cost
from gpuctl.ops.session import Session
from tests.unit.test_ops import fake, session  # noqa: F401  (fixture)


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


# --- the edges scripts/mutate found unchecked: a cluster's dollars by its billing rule, an epoch's
# rate, a run's time on its instances. A real ledger (sqlite in tmp_path), no provider.

H = 3600.0
SPOT = "Server.SpotInstanceTermination: Spot instance termination"
STORAGE_USD_PER_S = 100 * 0.08 / (730 * H)  # 100 GB of gp3


def inst(iid, launched=0.0, ended=H, rate=3.6, **kw):
    return InstanceRecord(id=iid, cluster="c", state="terminated" if ended is not None else "running",
                          launched_at=T0 + launched, terminated_at=None if ended is None else T0 + ended,
                          usd_per_hour=rate, workdir="/w", **kw)


T0 = 1_790_000_000.0


@pytest.fixture
def ledger_session(tmp_path):
    return Session(tmp_path / "home", env={"HOME": str(tmp_path / "user")})


def _cluster(s, instances, spec=None, down_at=None):
    c = s.ledger.add_cluster(spec or AwsSpec(name="c", provider="aws", billing="per-second", disk_gb=100))
    for i in instances:
        s.ledger.put_instance(c.id, i)
    if down_at is not None:
        s.ledger.mark_cluster_down(c.id, T0 + down_at)
    return s.ledger.cluster(c.id)


@pytest.mark.parametrize("instances, compute, storage_s, savings", [
    # on-demand for an hour: per second, its disk for as long
    ([inst("i-1")], 3.6, H, None),
    # stopped between two periods: each pays its 60 s minimum; the disk is billed while stopped too
    ([inst("i-1", ended=H + 90, periods=((T0, T0 + 30), (T0 + H, T0 + H + 90)))], 0.15, H + 90, None),
    # a period still open runs to the instance's end
    ([inst("i-1", ended=H, periods=((T0, None),))], 3.6, H, None),
    # spot: its price integrated piecewise, the savings against on-demand said
    ([inst("i-1", market="spot", price_steps=((T0, 0.4), (T0 + 1800, 0.6)), on_demand_usd_per_hour=2.0)],
     0.5, H, 1.5),
    # spot interrupted by EC2 in its first hour: the compute is free, the disk is not
    ([inst("i-1", ended=1800, market="spot", state_reason=SPOT, on_demand_usd_per_hour=2.0)], 0.0, 1800, 1.0),
    # on-demand, whatever on-demand price is recorded: no savings to speak of
    ([inst("i-1", on_demand_usd_per_hour=5.0)], 3.6, H, None),
    # two instances one after the other (a recovery): every dollar of both, each disk for its life
    ([inst("i-1", rate=1.0, market="spot", on_demand_usd_per_hour=2.0),
      inst("i-2", launched=H, ended=2 * H, rate=1.0, market="spot", on_demand_usd_per_hour=2.0)], 2.0, 2 * H, 2.0),
])
def test_a_per_second_clusters_dollars(ledger_session, instances, compute, storage_s, savings):
    cost, n = costs.cluster_cost(ledger_session, _cluster(ledger_session, instances), T0 + 10 * H)
    assert n == len(instances)
    assert cost.compute_usd == pytest.approx(compute, abs=1e-9)
    assert cost.storage_usd == pytest.approx(storage_s * STORAGE_USD_PER_S, abs=1e-12)
    assert cost.usd == pytest.approx(compute + storage_s * STORAGE_USD_PER_S, abs=1e-9)
    assert cost.spot_savings_usd == (None if savings is None else pytest.approx(savings))
    assert cost.uptime_s == pytest.approx(storage_s)


def test_an_hourly_rate_clusters_dollars_are_its_seconds_at_the_rate(ledger_session):
    spec = ClusterSpec(name="c", provider="local")
    c = _cluster(ledger_session, [inst("i-1", ended=10, rate=3.6), inst("i-2", launched=20, ended=10, rate=3.6)],
                 spec)
    cost, _ = costs.cluster_cost(ledger_session, c, T0 + H)
    # 10 s (no minute's minimum), and nothing for an end before its launch (a clock set back)
    assert cost.compute_usd == pytest.approx(0.01) and cost.storage_usd == 0.0


@pytest.mark.parametrize("instances, nodes, rate", [
    ([inst("i-1", rate=1.0), inst("i-2", launched=H, ended=None, rate=2.0)], 1, 2.0),  # what runs now
    ([inst("a", rate=1.0), inst("b", rate=2.0), inst("c", rate=3.0)], 2, 5.0),  # all ended: the last nodes
    ([inst("a", rate=1.0), inst("b", rate=2.0)], 1, 2.0),
])
def test_a_clusters_rate_is_what_runs_now_or_its_last_generation(ledger_session, instances, nodes, rate):
    spec = AwsSpec(name="c", provider="aws", billing="per-second", nodes=nodes)
    cost, _ = costs.cluster_cost(ledger_session, _cluster(ledger_session, instances, spec), T0 + 2 * H)
    assert cost.usd_per_hour == rate


def test_an_instance_with_no_end_of_a_cluster_that_is_down_ends_with_the_cluster(ledger_session):
    c = _cluster(ledger_session, [inst("i-1", ended=None)], down_at=H)
    cost, _ = costs.cluster_cost(ledger_session, c, T0 + 10 * H)
    assert cost.uptime_s == pytest.approx(H) and cost.compute_usd == pytest.approx(3.6)


def test_a_cluster_with_no_instance_cost_nothing(ledger_session):
    cost, n = costs.cluster_cost(ledger_session, _cluster(ledger_session, []), T0 + H)
    assert (n, cost.uptime_s, cost.usd, cost.usd_per_hour) == (0, 0.0, 0.0, 0.0)


def _seg(iid, start, end=None, rate=3.6, why=None):
    return Segment(instance_id=iid, usd_per_hour=rate, started_at=T0 + start,
                   ended_at=None if end is None else T0 + end, end=why)


def epoch_at(n, end, seconds=36.0, **kw):
    return EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": n, "start": T0 + end - seconds, "end": T0 + end, "seconds": seconds,
        "usd_per_hour": 0, "epoch_cost_usd": 0, "cumulative_usd": 0, **kw})


@pytest.mark.parametrize("end, rate", [
    (50, 3.6), (100, 3.6),  # inside the first stretch, and at its very end
    (150, 1.0),  # between two stretches: the run's own rate
    (200, 7.2), (250, 7.2),  # from the second's very start
])
def test_an_epoch_costs_the_rate_of_the_stretch_it_ended_in(end, rate):
    r = run(usd_per_hour=1.0, started_at=T0, segments=(_seg("i-1", 0, 100, 3.6), _seg("i-2", 200, rate=7.2)))
    (row,) = run_cost(r, [epoch_at(1, end)]).epochs
    assert row.epoch_cost_usd == pytest.approx(36 * rate / 3600)


@pytest.mark.parametrize("seconds, start_to_end, usd", [
    (36.0, 36.0, 0.036), (36.0, 10.0, 0.036), (10.0, 36.0, 0.036),  # the longer of its two times
    (0.0, 0.0, 0.0),  # no time: nothing (never a floor)
])
def test_an_epoch_costs_at_least_its_longer_time_at_the_rate(seconds, start_to_end, usd):
    e = EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": 1, "start": T0, "end": T0 + start_to_end, "seconds": seconds,
        "usd_per_hour": 0, "epoch_cost_usd": 0, "cumulative_usd": 0})
    assert run_cost(run(), [e]).epochs[0].epoch_cost_usd == pytest.approx(usd, abs=1e-12)


def test_a_runs_cost_carries_each_epochs_figures_and_the_rates_per_example():
    epochs = [epoch_at(n, 36.0 * n, examples=1000, examples_per_s=1000 / 36, gpu_util_percent=50 + n,
                       gpu_memory_used_mib=100.0 * n, epochs_planned=None, metrics={"loss": 1.0 / n}) for n in (1, 2, 3)]
    c = run_cost(run(tensorflow="2.21", image="img"), epochs)
    assert c.epochs_planned is None and c.projected_finish_at is None  # nobody said how many
    assert [(e.examples, e.examples_per_s, e.gpu_util_percent, e.gpu_memory_used_mib) for e in c.epochs] == [
        (1000, pytest.approx(1000 / 36), 50 + n, 100.0 * n) for n in (1, 2, 3)]
    assert [e.metrics for e in c.epochs] == [{"loss": 1.0 / n} for n in (1, 2, 3)]
    assert c.examples_per_s == pytest.approx(1000 / 36)
    assert c.usd_per_million_examples == pytest.approx(c.spent_usd / 3000 * 1e6)
    assert (c.tensorflow, c.image) == ("2.21", "img")
    planned = run_cost(run(), [*epochs[:2], epoch_at(3, 36.0 * 3, epochs_planned=5)])
    assert planned.epochs_planned == 5
    assert planned.projected_finish_at == pytest.approx(T0 + 108 + 2 * 36, abs=1e-6)  # two more of the mean epoch
    none = run_cost(run(), [epoch_at(1, 36.0, examples=None)])
    assert none.examples_per_s is None and none.usd_per_million_examples is None


def test_a_runs_time_on_its_instances(ledger_session):
    c = _cluster(ledger_session, [inst("i-1", ended=100, market="spot", state_reason=SPOT),
                                  inst("i-2", launched=200, ended=None, rate=7.2)])
    r = run(cluster_id=c.id, started_at=T0, usd_per_hour=1.0,
            segments=(_seg("i-1", 0, 100, 3.6, "preempted"), _seg("i-2", 200, rate=7.2)))
    elapsed, usd, segs = costs.on_instance(ledger_session, r, [], T0 + 300)
    assert elapsed == pytest.approx(300) and len(segs) == 2
    assert usd == pytest.approx(100 * 7.2 / 3600)  # i-1 was interrupted by EC2 in its first hour: free
    assert costs.on_instance(ledger_session, r.model_copy(update={"state": "queued"}), [], T0 + 300) == (0.0, 0.0, ())
    plain = run(cluster_id=c.id, started_at=T0, ended_at=T0 - 5, usd_per_hour=3.6)  # a clock set back
    assert costs.on_instance(ledger_session, plain, [], T0 + 300) == (0.0, 0.0, ())
    assert costs.on_instance(ledger_session, run(cluster_id=c.id, started_at=T0, ended_at=T0 + 100), [],
                             T0 + 300)[:2] == (pytest.approx(100), pytest.approx(0.1))


def _finished_run(s, c, run_id, seconds, epochs, planned=None):
    """A run that ended `seconds` after it started on cluster c, with `epochs` epochs of 36 s each
    said to cost their time at $3.6/h."""
    start = time.time() - 1000
    s.ledger.put_run(RunRecord(run_id=run_id, cluster=c.name, cluster_id=c.id, project="/p", entry="t.py",
                               state="succeeded", started_at=start, ended_at=start + seconds, usd_per_hour=3.6,
                               run_dir=f"/fake/{run_id}", epochs_planned=planned))
    s.ledger.put_epochs([EpochReport.model_validate({
        "schema": 1, "run_id": run_id, "epoch": n, "start": start + 36 * (n - 1), "end": start + 36 * n,
        "seconds": 36, "usd_per_hour": 3.6, "epoch_cost_usd": 0.036, "cumulative_usd": 0.036 * n})
        for n in range(1, epochs + 1)])


def test_cost_splits_each_clusters_dollars_into_its_runs_epochs_and_idle(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    c = clusters.up(s, UpRequest(usd_per_hour=3.6)).cluster
    _finished_run(s, c, "r-a", 100, 2)  # $0.072 in epochs
    _finished_run(s, c, "r-b", 100, 1)  # $0.036
    _finished_run(s, c, "r-none", 100, 0, planned=4)  # no epoch reported: its time on the instance
    report = costs.cost(s)
    by_id = {r.run_id: r for r in report.runs}
    assert by_id["r-a"].spent_usd == pytest.approx(0.072) and by_id["r-a"].spent_from == "epochs"
    assert by_id["r-none"].spent_from == "wall time" and by_id["r-none"].spent_usd == pytest.approx(0.1)
    assert by_id["r-none"].wall_s == pytest.approx(100) and by_id["r-none"].epochs_planned == 4
    (cc,) = report.clusters
    assert cc.idle_usd == pytest.approx(max(0.0, cc.usd - (0.072 + 0.036 + 0.1)))
    assert report.total_usd == pytest.approx(cc.usd)
    one = costs.cost(s, run_ids=("r-b",))
    assert [r.run_id for r in one.runs] == ["r-b"] and one.clusters[0].idle_usd is None


def test_a_run_whose_epochs_say_next_to_nothing_costs_its_time_and_projects_from_that(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    c = clusters.up(s, UpRequest(usd_per_hour=3.6)).cluster
    start = time.time() - 1000
    s.ledger.put_run(RunRecord(run_id="r", cluster=c.name, cluster_id=c.id, project="/p", entry="t.py",
                               state="succeeded", started_at=start, ended_at=start + 1000, usd_per_hour=3.6,
                               run_dir="/fake/r", epochs_planned=10))
    # Two epochs of no time at all, said free: under 1% of the run's $1 on its instance.
    s.ledger.put_epochs([EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": n, "start": start + 10 * n, "end": start + 10 * n, "seconds": 0,
        "usd_per_hour": 0, "epoch_cost_usd": 0, "cumulative_usd": 0}) for n in (1, 2)])
    (rc,) = costs.cost(s).runs
    assert rc.spent_from == "wall time" and rc.spent_usd == pytest.approx(1.0) and rc.wall_s == pytest.approx(1000)
    assert rc.mean_epoch_usd == pytest.approx(0.5)
    assert rc.projected_total_usd == pytest.approx(5.0) and rc.projected_remaining_usd == pytest.approx(4.0)


def test_compare_needs_two_runs(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    with pytest.raises(ConfigError) as err:
        costs.cost(s, ("r-a",), compare=True)
    assert (err.value.message, err.value.hint) == ("--compare needs at least two runs",
                                                  "Name two or more: gpuctl cost --compare RUN1 RUN2")


@pytest.mark.parametrize("seconds, planned, finish", [
    (0.0, 5, 0.0),  # epochs of no time: the rest take none either (not a second each)
    (36.0, 3, 0.0),  # all planned epochs done: it finished at its last epoch's end
    (36.0, 5, 72.0),
])
def test_the_projected_finish(seconds, planned, finish):
    epochs = [epoch_at(n, 36.0 * n, seconds=seconds, epochs_planned=planned) for n in (1, 2, 3)]
    c = run_cost(run(epochs_planned=planned), epochs)
    assert c.projected_finish_at == pytest.approx(T0 + 108 + finish, abs=1e-6)


def test_cost_carries_a_runs_stretches_and_machine(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    c = clusters.up(s, UpRequest(usd_per_hour=3.6)).cluster
    (first,) = s.ledger.instances(c.id)
    s.ledger.put_instance(c.id, first.model_copy(update={"instance_type": "g5.xlarge", "market": "spot"}))
    start = time.time() - 1000
    segs = (Segment(instance_id=first.id, usd_per_hour=3.6, started_at=start, ended_at=start + 100, end="preempted"),
            Segment(instance_id="i-next", usd_per_hour=7.2, started_at=start + 130, ended_at=start + 330,
                    end="succeeded"))
    s.ledger.put_run(RunRecord(run_id="r", cluster=c.name, cluster_id=c.id, project="/p", entry="t.py",
                               state="succeeded", started_at=start, ended_at=start + 330, usd_per_hour=7.2,
                               run_dir="/fake/r", segments=segs))
    s.ledger.put_epochs([epoch_at(1, 40.0 - T0 + start, seconds=36.0)])  # done 40 s in: 60 s lost at 100
    (rc,) = costs.cost(s).runs
    assert (rc.instance_type, rc.market) == ("g5.xlarge", "spot")
    assert [g.instance_id for g in rc.segments] == [first.id, "i-next"]
    assert rc.instances_usd == pytest.approx(100 * 3.6 / 3600 + 200 * 7.2 / 3600)
    assert (rc.lost_s, rc.lost_usd, rc.waited_s) == (pytest.approx(60), pytest.approx(60 * 3.6 / 3600),
                                                     pytest.approx(30))
    assert rc.spent_from == "epochs" and rc.spent_usd == pytest.approx(36 * 3.6 / 3600)  # its epoch, at its rate


def test_cost_hands_each_run_on_with_its_rows_and_keeps_it_without(fake, tmp_path):  # noqa: F811
    """`cost --json` writes each run away as it is made (issue 39: memory flat in the runs): the
    report it gets back holds no run's rows, and every figure is the same as without each_run."""
    s = session(tmp_path)
    c = clusters.up(s, UpRequest(usd_per_hour=3.6)).cluster
    _finished_run(s, c, "r-a", 100, 2)
    _finished_run(s, c, "r-b", 100, 3)
    handed: list = []
    report = costs.cost(s, each_run=handed.append)
    whole = costs.cost(s)
    assert [r.epochs for r in report.runs] == [(), ()]
    assert handed == list(whole.runs) and [len(r.epochs) for r in handed] == [2, 3]
    assert list(report.runs) == [r.model_copy(update={"epochs": ()}) for r in whole.runs]


def test_epoch_rows_are_what_validating_them_would_make():
    """run_cost sets its rows up without validating them again (their values come from validated
    reports): validation makes each the same, field types and JSON included."""
    from gpuctl.model.results import EpochRow

    run = RunRecord(run_id="r", cluster="c", project="/p", entry="t.py", state="succeeded", started_at=0.0,
                    run_dir="/r", usd_per_hour=3.6, epochs_planned=4)
    epochs = [EpochReport.model_validate({
        "schema": 1, "run_id": "r", "epoch": n, "start": 36.0 * (n - 1), "end": 36.0 * n, "seconds": 36,
        "usd_per_hour": 3.6, "epoch_cost_usd": 0.036, "cumulative_usd": 0.036 * n, "examples": None if n == 2 else 500,
        "metrics": {"loss": 1 / n, "n": n}, "gpu_util_percent": 50 if n == 3 else None})
        for n in range(1, 4)]
    rows = run_cost(run, epochs).epochs
    assert len(rows) == 3
    for row in rows:
        again = EpochRow.model_validate(row.model_dump())
        assert again == row and again.model_dump_json() == row.model_dump_json()
        assert [type(v) for v in again.__dict__.values()] == [type(v) for v in row.__dict__.values()]
        assert row.model_fields_set == again.model_fields_set
