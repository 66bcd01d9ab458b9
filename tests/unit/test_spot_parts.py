"""The parts of spot recovery that need no cloud: EC2's billing rule for interrupted spot instances,
a run's segments (lost work, waits, dollars), the status line, and the notice poller against the
fake IMDSv2 over real HTTP (token required)."""

from __future__ import annotations

import time

import pytest

from gpuctl.cli.render import clock
from gpuctl.cli.render.cost import history
from gpuctl.model import billing
from gpuctl.model.records import EpochReport, InstanceRecord, RunRecord, Segment
from gpuctl.ops.segments import segment_costs
from gpuctl.payloads import gpuctl_notice

T0 = 1_790_000_000.0
SPOT_REASON = "Server.SpotInstanceTermination: Spot instance termination"


def _inst(iid, launched, ended=None, reason=None, market="spot"):
    return InstanceRecord(id=iid, cluster="c", state="terminated" if ended else "running", launched_at=launched,
                          terminated_at=ended, state_reason=reason, market=market, usd_per_hour=0.36, workdir="/w",
                          zone="us-east-1a")


def _epoch(n, start, end):
    return EpochReport.model_validate({"schema": 1, "run_id": "r", "epoch": n, "start": start, "end": end,
                                       "seconds": end - start, "usd_per_hour": 0.36, "epoch_cost_usd": 0.001,
                                       "cumulative_usd": 0.001 * n})


def _run(segments, state="succeeded", ended_at=None):
    return RunRecord(run_id="r", cluster="c", cluster_id=1, project="/p", entry="train.py", state=state,
                     started_at=segments[0].started_at, ended_at=ended_at, run_dir="/w/runs/r", segments=segments)


def test_ec2_does_not_bill_a_spot_instance_it_interrupts_in_its_first_hour():
    assert billing.interruption_is_free("spot", SPOT_REASON, T0, T0 + 3599)
    assert not billing.interruption_is_free("spot", SPOT_REASON, T0, T0 + 3601)  # seconds used after the first hour
    assert not billing.interruption_is_free("spot", "Client.UserInitiatedShutdown: User initiated shutdown", T0, T0 + 60)
    assert not billing.interruption_is_free("on-demand", SPOT_REASON, T0, T0 + 60)
    assert not billing.interruption_is_free("spot", SPOT_REASON, T0, None)  # still running


def test_segments_count_lost_work_waits_and_each_instance():
    first = Segment(instance_id="i-1", zone="us-east-1a", market="spot", usd_per_hour=0.36, started_at=T0,
                    ended_at=T0 + 100, end="preempted")
    second = Segment(instance_id="i-2", zone="us-east-1c", market="spot", usd_per_hour=0.72, started_at=T0 + 292,
                     ended_at=T0 + 492, end="succeeded")
    epochs = [_epoch(1, T0 + 10, T0 + 40), _epoch(2, T0 + 40, T0 + 70),  # epoch 3 was cut at T0+100
              *[_epoch(n, T0 + 300 + 40 * (n - 3), T0 + 340 + 40 * (n - 3)) for n in (3, 4, 5, 6)]]
    run = _run((first, second), ended_at=T0 + 492)
    # i-1 interrupted by EC2 in its first hour: free; i-2 ended by its run: billed.
    instances = {"i-1": _inst("i-1", T0 - 60, T0 + 130, SPOT_REASON), "i-2": _inst("i-2", T0 + 200, T0 + 600,
                                                                                   "Client.UserInitiatedShutdown")}
    a, b = segment_costs(run, epochs, instances, now=T0 + 1000)
    assert a.free and a.usd == 0 and a.lost_s == pytest.approx(30) and a.lost_usd == 0
    assert not b.free and b.usd == pytest.approx(200 * 0.72 / 3600) and b.lost_s == 0
    assert b.waited_s == pytest.approx(192)
    # Billed when EC2 interrupted it after its first hour: the cut work costs money then.
    instances["i-1"] = _inst("i-1", T0 - 7200, T0 + 130, SPOT_REASON)
    a, _ = segment_costs(run, epochs, instances, now=T0 + 1000)
    assert not a.free and a.lost_usd == pytest.approx(30 * 0.36 / 3600)
    # The status line says where the run went.
    line = history(segment_costs(run, epochs, instances, T0 + 1000), "succeeded")
    assert line == f"preempted at {clock(T0 + 100)} in us-east-1a, resumed on i-2 in us-east-1c after 3m12s"


def test_a_run_that_stayed_on_one_instance_has_no_story_and_a_preempted_one_says_it_waits():
    only = Segment(instance_id="i-1", zone="us-east-1a", started_at=T0, ended_at=T0 + 50, end="succeeded")
    assert history(segment_costs(_run((only,), ended_at=T0 + 50), [], {}, T0 + 60), "succeeded") == ""
    cut = only.model_copy(update={"end": "preempted"})
    line = history(segment_costs(_run((cut,), "preempted", T0 + 50), [], {}, T0 + 60), "preempted")
    assert "preempted at" in line and "train --resume" in line
    # A run with no segments (recorded before them) reports as before.
    assert segment_costs(_run((only,)).model_copy(update={"segments": ()}), [], {}, T0) == ()


def _watch(imds, rounds: int, endpoint: str | None = None):
    """Run the notice poller for `rounds` polls; what its handlers and log heard."""
    heard = {"interruption": [], "rebalance": [], "log": []}
    calls = [0]

    def sleep(_s):
        calls[0] += 1
        if calls[0] >= rounds:
            raise StopIteration

    cfg = {"notice": {"endpoint": endpoint or imds.url(), "interval_s": 5}}
    with pytest.raises(StopIteration):
        gpuctl_notice.watch(lambda: cfg, heard["interruption"].append, heard["rebalance"].append,
                            heard["log"].append, sleep=sleep)
    return heard


def test_the_poller_asks_with_a_token_and_hears_each_notice_once(imds):
    assert _watch(imds, 2) == {"interruption": [], "rebalance": [], "log": []}  # 404: nothing pending
    imds.rebalance()
    imds.interrupt(action="stop")
    heard = _watch(imds, 3)
    (notice,) = heard["interruption"]  # three polls, one call
    assert notice["action"] == "stop" and notice["time"] and notice["seen_at"] <= time.time()
    assert len(heard["rebalance"]) == 1
    assert all(imds.gets("/latest/meta-data/spot/instance-action"))  # never without the token
    # A token that stopped working (IMDS restarted) is replaced once, not fatal.
    imds.tokens.clear()
    assert len(_watch(imds, 1)["interruption"]) == 1


def test_an_unreachable_metadata_service_is_logged_once_and_never_raised():
    heard = _watch(None, 3, endpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    assert heard["interruption"] == [] and len(heard["log"]) == 1 and "cannot ask the metadata service" in heard["log"][0]


def test_odd_notice_bodies_are_not_trusted_beyond_their_strings(imds):
    imds._put("/latest/meta-data/spot/instance-action", '["not", "a", "dict"]')
    (notice,) = _watch(imds, 1)["interruption"]  # still a notice: the answer is there
    assert set(notice) == {"seen_at"}
    imds._put("/latest/meta-data/spot/instance-action", '{"action": "terminate", "time": "' + "x" * 500 + '", "evil": 1}')
    (notice,) = _watch(imds, 1)["interruption"]
    assert set(notice) == {"action", "time", "seen_at"} and len(notice["time"]) == 64


def test_a_failing_notice_handler_is_logged_and_tried_again(imds):
    imds.interrupt()
    calls = []

    def handler(notice):
        calls.append(notice)
        if len(calls) == 1:
            raise KeyError("runs_dir")  # e.g. a config being rewritten at that moment

    log: list[str] = []
    rounds = [0]

    def sleep(_s):
        rounds[0] += 1
        if rounds[0] >= 3:
            raise StopIteration

    with pytest.raises(StopIteration):
        gpuctl_notice.watch(lambda: {"notice": {"endpoint": imds.url()}}, handler, lambda n: None, log.append,
                            sleep=sleep)
    assert len(calls) == 2  # failed once, handled at the next poll, then never again
    assert any("handling the interruption notice failed (KeyError" in line for line in log)


def test_a_multi_node_segment_bills_each_node_by_its_own_end():
    # Node 1's machine EC2 took in its first hour (free); the chief's gpuctl ended (billed).
    seg = Segment(instance_id="i-0", node_ids=("i-1",), market="spot", usd_per_hour=0.72, started_at=T0,
                  ended_at=T0 + 100, end="preempted")
    instances = {"i-0": _inst("i-0", T0 - 60, T0 + 110, "Client.UserInitiatedShutdown"),
                 "i-1": _inst("i-1", T0 - 60, T0 + 130, SPOT_REASON)}
    (a,) = segment_costs(_run((seg,), state="preempted", ended_at=T0 + 100), [], instances, now=T0 + 1000)
    assert not a.free and a.usd == pytest.approx(100 * 0.36 / 3600)
    instances["i-0"] = _inst("i-0", T0 - 60, T0 + 110, SPOT_REASON)  # both taken by EC2: free
    (a,) = segment_costs(_run((seg,), state="preempted", ended_at=T0 + 100), [], instances, now=T0 + 1000)
    assert a.free and a.usd == 0


def _seg(start, end=None, why=None, iid="i-1", rate=3.6):
    return Segment(instance_id=iid, usd_per_hour=rate, started_at=T0 + start,
                   ended_at=None if end is None else T0 + end, end=why)


# Each row: the run's segments (and the run's state and end), its epochs' ends, now; what each
# segment counts (seconds, lost seconds, wait). The edges scripts/mutate found unchecked.
@pytest.mark.parametrize("segments, state, ended, epoch_ends, now, want", [
    # An open segment of a finished run ends with the run, not now; of a running run, now.
    ([_seg(0)], "succeeded", 50, [], 1000, [(50, 0, 0)]),
    ([_seg(0)], "running", 50, [], 1000, [(1000, 0, 0)]),
    ([_seg(0)], "running", None, [], 1000, [(1000, 0, 0)]),
    ([_seg(0, -10, "failed")], "failed", -10, [], 1000, [(0, 0, 0)]),  # a clock set back: no seconds
    # A stop or a failure throws work away only when the run went on after it (resumed)...
    ([_seg(0, 100, "stopped"), _seg(100, 400, "failed", "i-2")], "failed", 400, [40, 350], 1000,
     [(100, 60, 0), (300, 0, 0)]),
    # ...a preemption or a loss always does, the last segment too; none after the last epoch's end.
    ([_seg(0, 100, "preempted")], "preempted", 100, [40], 1000, [(100, 60, 0)]),
    ([_seg(0, 100, "lost")], "lost", 100, [40], 1000, [(100, 60, 0)]),
    ([_seg(0, 100, "preempted")], "preempted", 100, [40, 100], 1000, [(100, 0, 0)]),
    # The wait before a segment; none before the first, none when it started as the last ended.
    ([_seg(0, 100, "preempted"), _seg(100, 200, "succeeded", "i-2")], "succeeded", 200, [100, 200], 1000,
     [(100, 0, 0), (100, 0, 0)]),
    ([_seg(0, 100, "preempted"), _seg(130, 200, "succeeded", "i-2")], "succeeded", 200, [100, 200], 1000,
     [(100, 0, 0), (70, 0, 30)]),
])
def test_segment_seconds_lost_work_and_waits(segments, state, ended, epoch_ends, now, want):
    run = _run(tuple(segments), state=state, ended_at=None if ended is None else T0 + ended)
    epochs = [_epoch(n, T0 + e - 1, T0 + e) for n, e in enumerate(epoch_ends, 1)]
    got = segment_costs(run, epochs, {}, now=T0 + now)
    assert [(g.seconds, g.lost_s, g.waited_s) for g in got] == [tuple(map(pytest.approx, w)) for w in want]
    assert [g.usd for g in got] == [pytest.approx(w[0] * 3.6 / 3600) for w in want]
