"""gpuctl's waits on a driven clock (tests/waits.py's FakeClock): the minutes they stand for take
no real time, and the pauses they make are the ones a user waits through."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from gpuctl.errors import RemoteError
from gpuctl.model.records import InstanceRecord
from gpuctl.ops import run_state
from gpuctl.provision.aws import lifecycle
from tests.waits import FakeClock


def _young_spot(id_: str) -> InstanceRecord:
    return InstanceRecord(id=id_, cluster="c", state="running", market="spot", launched_at=time.time() - 60,
                          workdir="/w")


def test_ec2_gets_its_grace_on_the_clock_and_what_it_ended_is_not_ended_again() -> None:
    clock = FakeClock()
    start = clock.now
    ended_by_us: list[str] = []

    def reconcile(left: list[InstanceRecord]) -> list[InstanceRecord]:  # EC2 ends it 30 s in
        state = "terminated" if clock.now - start >= 30 else "running"
        return [i.model_copy(update={"state": state}) for i in left]

    def end(instances: list[InstanceRecord]) -> list[InstanceRecord]:
        ended_by_us.extend(i.id for i in instances)
        return [i.model_copy(update={"state": "terminated"}) for i in instances]

    out = lifecycle.end_interrupted([_young_spot("i-1")], reconcile, end, lambda _: None, clock=clock)
    assert clock.slept == [lifecycle.EC2_POLL_S] * 6 and ended_by_us == []
    assert [i.state for i in out] == ["terminated"]


def test_an_instance_ec2_never_ends_is_ended_when_the_grace_is_over() -> None:
    clock = FakeClock()
    ended_by_us: list[str] = []

    def end(instances: list[InstanceRecord]) -> list[InstanceRecord]:
        ended_by_us.extend(i.id for i in instances)
        return list(instances)

    lifecycle.end_interrupted([_young_spot("i-1")], lambda left: left, end, lambda _: None, clock=clock)
    assert sum(clock.slept) == lifecycle.EC2_GRACE_S and set(clock.slept) == {lifecycle.EC2_POLL_S}
    assert ended_by_us == ["i-1"]


class _Looks:
    """A session as run_state.wait and run_state.logs use it, over one run whose looks are
    scripted (`states`: what each refresh finds, the last for good); its clock is driven. The instance's side is scripted
    here because what is tested is the pacing between looks, not the looks."""

    def __init__(self, states: list[str]):
        self.clock = FakeClock()
        self.states = states
        self.run = SimpleNamespace(run_id="r1", nodes=1, tf_log_level=0, state="running")

    def find_run(self, run_id: str | None) -> SimpleNamespace:
        return self.run

    def live_cluster_of(self, run: object) -> None:
        return None

    def refresh(self, s: object, run: SimpleNamespace) -> SimpleNamespace:  # run_state.settle, scripted
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        self.run = SimpleNamespace(**{**vars(run), "state": state})
        return self.run


def test_wait_gives_up_after_its_timeout_on_the_sessions_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _Looks(["running"])
    monkeypatch.setattr(run_state, "settle", s.refresh)
    with pytest.raises(RemoteError, match="run r1 still running after 60s"):
        run_state.wait(s, "r1", poll_s=1.0, timeout_s=60)  # type: ignore[arg-type]
    assert s.clock.slept == [1.0] * 60
    ends = _Looks(["running", "running", "succeeded"])
    monkeypatch.setattr(run_state, "settle", ends.refresh)
    assert run_state.wait(ends, "r1").state == "succeeded"  # type: ignore[arg-type]
    assert ends.clock.slept == [1.0, 1.0]


def test_a_followed_log_is_looked_at_soon_after_output_then_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [b"a\n", b"", b"", b"", b"", b"", b"b\n", b"", b"", b""]
    s = _Looks(["running"] * 8 + ["succeeded"])  # a refresh after each look but the last
    monkeypatch.setattr(run_state, "settle", s.refresh)
    monkeypatch.setattr(run_state, "_read_log", lambda *_: chunks.pop(0) if chunks else b"")
    assert "".join(run_state.logs(s, "r1", follow=True, poll_s=0.5)) == "a\nb\n"  # type: ignore[arg-type]
    assert s.clock.slept == [0.1, 0.2, 0.4, 0.5, 0.5, 0.1, 0.2]
