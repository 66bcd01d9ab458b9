"""gpuctl's waits on a driven clock (tests/waits.py's FakeClock): the minutes they stand for take
no real time, and the pauses they make are the ones a user waits through."""

from __future__ import annotations

import time

from gpuctl.model.records import InstanceRecord
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
