"""verdicts.decide: a run's state and what to do about it from what a look saw (pure: no host, no
clock). Each row is a case where a silent bug costs money: a node left waiting, billed, for a peer
that ended; a node stopped that was saving or finishing; a run called over while it trains."""

from __future__ import annotations

import pytest

from gpuctl.model.records import InstanceRecord, RunRecord
from gpuctl.ops.verdicts import NOT_STARTED, Decision, NodeState, decide, needs_notices, verdict, with_gone, with_notices

NOW = 1_000_000.0


def S(rank, state, code=None, at=None):
    return NodeState(rank, state, code, at)


def run(**kw) -> RunRecord:
    fields = dict(run_id="r", cluster="c", project="/p", entry="t.py", state="running", started_at=NOW - 60,
                  run_dir="/w/runs/r", nodes=2)
    return RunRecord(**{**fields, **kw})


QUEUED, STARTED = {"state": "queued", "position": 1}, {"state": "running"}

CASES = [
    # (why, run fields, nodes seen, queue place, chief asked) -> (state, code, failed node, stop, late)
    ("every node succeeded", {}, [S(0, "succeeded", 0, 5.0), S(1, "succeeded", 0, 4.0)], None, True,
     ("succeeded", 0, None, (), ())),
    ("the chief is done, a worker still finishing: never stopped", {},
     [S(0, "succeeded", 0, 5.0), S(1, "running")], None, True, ("running", None, None, (), ())),
    ("a worker failed first: the run failed there, the one still waiting is stopped", {},
     [S(0, "failed", 1, 14.0), S(1, "failed", 137, 10.0), S(2, "running")], None, True,
     ("failed", 137, 1, (2,), ())),
    ("a worker's session is gone: lost there, the chief (which would wait) is stopped", {},
     [S(0, "running"), S(1, "lost")], None, True, ("lost", None, 1, (0,), ())),
    ("a node starting as itself is still running a run that ended: stopped too", {},
     [S(0, "failed", 1, 3.0), S(1, "starting")], None, True, ("failed", 1, 0, (1,), ())),
    ("a node stopped by a notice decides over a peer that failed before", {},
     [S(0, "failed", 1, 12.0), S(1, "preempted", 75, 13.0)], None, True, ("preempted", 75, 1, (), ())),
    ("the chief preempted: the worker still running is stopped", {},
     [S(0, "preempted", 75, 3.0), S(1, "running")], None, True, ("preempted", 75, 0, (1,), ())),
    ("a node leaving on a notice is waited for and never stopped (it saves the checkpoint)", {},
     [S(0, "failed", 1, 12.0), S(1, "leaving")], None, True, ("running", None, None, (), ())),
    ("one node: failed, nothing left to stop", {"nodes": 1}, [S(0, "failed", 2, 3.0)], None, True,
     ("failed", 2, 0, (), ())),
    ("one node running", {"nodes": 1}, [S(0, "running")], None, True, ("running", None, None, (), ())),
    ("waiting in the queue (no place written yet)", {"gpus": 1}, [S(0, "running"), S(1, "running")], None, True,
     ("queued", None, None, (), ())),
    ("waiting in the queue", {"gpus": 1}, [S(0, "running"), S(1, "running")], QUEUED, True,
     ("queued", None, None, (), ())),
    ("past the queue", {"gpus": 1}, [S(0, "running"), S(1, "running")], STARTED, True,
     ("running", None, None, (), ())),
    ("the chief's machine gone: its queue cannot be asked, the run is not called queued",
     {"gpus": 1}, [S(1, "running")], None, False, ("running", None, None, (), ())),
    ("a node not started past the deadline: failed there, every node stopped", {"start_timeout_s": 30},
     [S(0, "running"), S(1, "starting")], None, True, ("failed", None, 1, (0, 1), (1,))),
    ("within the start deadline: a node starting is waited for", {"start_timeout_s": 120},
     [S(0, "running"), S(1, "starting")], None, True, ("running", None, None, (), ())),
    ("the deadline counts from the resume", {"start_timeout_s": 30, "resumed_at": NOW - 10},
     [S(0, "running"), S(1, "starting")], None, True, ("running", None, None, (), ())),
    ("queued: the wait in the queue is no late start", {"start_timeout_s": 30, "gpus": 1},
     [S(0, "running"), S(1, "starting")], QUEUED, True, ("queued", None, None, (), ())),
    ("ended at an earlier look, the chief still waits: its verdict kept, the chief to stop",
     {"state": "failed", "exit_code": 137, "failed_node": 1, "node_states": ("running", "failed")},
     [S(0, "running"), S(1, "failed", 137, 10.0)], None, True, ("failed", 137, 1, (0,), ())),
    ("ended earlier, the chief since ended by itself: nothing to stop, the verdict unchanged",
     {"state": "failed", "exit_code": 137, "failed_node": 1}, [S(0, "failed", 1, 20.0), S(1, "failed", 137, 10.0)],
     None, True, ("failed", 137, 1, (), ())),
]


@pytest.mark.parametrize("why, fields, seen, place, chief, want", CASES, ids=[c[0] for c in CASES])
def test_decide(why, fields, seen, place, chief, want):
    d = decide(run(**fields), seen, place, NOW, chief=chief)
    assert (d.state, d.exit_code, d.failed_node, d.stop, d.late) == want
    assert d.nodes == tuple(seen)


def test_a_decision_is_frozen():
    d = decide(run(), [S(0, "running"), S(1, "lost")], None, NOW)
    with pytest.raises(AttributeError):
        d.stop = ()  # type: ignore[misc]


@pytest.mark.parametrize("decision, unconfirmed, want", [
    (Decision("lost", None, 1, (S(0, "running"), S(1, "lost")), stop=(0,)), set(), ("stopped", "lost")),
    # tmux did not confirm the stop: not called stopped while it may train on
    (Decision("lost", None, 1, (S(0, "running"), S(1, "lost")), stop=(0,)), {0}, ("running", "lost")),
    (Decision("failed", None, 1, (S(0, "running"), S(1, "starting")), stop=(0, 1), late=(1,)), set(),
     ("stopped", NOT_STARTED)),
])
def test_the_nodes_states_after_the_stop(decision, unconfirmed, want):
    assert decision.after_stop(unconfirmed) == want


def test_a_node_whose_machine_ended_counts_as_lost_unless_the_rest_succeeded():
    gone = InstanceRecord(id="i-1", node=1, cluster="c", state="terminated", launched_at=0.0, terminated_at=9.0,
                          workdir="/w")
    assert verdict(with_gone([S(0, "failed", 1, 12.0)], gone)) == ("lost", None, 1)
    # Each node powered its machine off after its job (down_after_run): the run succeeded.
    assert verdict(with_gone([S(0, "succeeded", 0, 8.0)], gone)) == ("succeeded", 0, None)
    assert with_gone([S(0, "running")], None) == [S(0, "running")]
    # The chief, waiting for the gone worker, is to be stopped.
    assert decide(run(), with_gone([S(0, "running")], gone), None, NOW).stop == (0,)


def test_a_notice_makes_a_node_leaving_while_it_runs_and_preempted_once_ended():
    seen = with_notices([S(0, "failed", 1, 12.0), S(1, "running")], {1})
    assert [n.state for n in seen] == ["failed", "leaving"]
    ended = with_notices([S(0, "failed", 1, 12.0), S(1, "failed", 1, 14.0)], {1})
    assert verdict(ended) == ("preempted", 1, 1)


def test_notices_are_read_only_where_the_run_would_end():
    assert not needs_notices(run(), [S(0, "running"), S(1, "running")])
    assert needs_notices(run(), [S(0, "failed", 1, 1.0), S(1, "running")])
    assert not needs_notices(run(nodes=1), [S(0, "failed", 1, 1.0)])
    assert not needs_notices(run(state="failed"), [S(0, "running"), S(1, "failed", 1, 1.0)])
