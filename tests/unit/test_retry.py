"""gpuctl.retry's backoff on a driven clock: every test here takes no real time."""

from __future__ import annotations

import math
import threading
import time

import pytest

from gpuctl.retry import REAL_CLOCK, Backoff, EventClock, TimedOut, poll
from tests.waits import FakeClock, wait_for


def test_poll_sleeps_first_delay_doubling_to_the_cap_and_gives_up_before_passing_the_deadline() -> None:
    clock = FakeClock()
    tries: list[float] = []
    with pytest.raises(TimedOut) as info:
        poll(lambda: tries.append(clock.now), 60, first_delay_s=0.5, max_delay_s=8.0, describe=lambda: "closed",
             clock=clock)
    assert clock.slept == [0.5, 1, 2, 4, 8, 8, 8, 8, 8, 8]  # 55.5 s: another 8 would pass 60
    assert len(tries) == len(clock.slept) + 1  # a try before each pause and one after the last
    assert str(info.value) == "timed out after 56s (closed)" and info.value.last == "closed"


def test_poll_returns_the_first_answer_that_is_not_none_and_hears_each_wait() -> None:
    clock = FakeClock()
    answers = iter([None, None, 0])  # a falsy answer that is not None is an answer
    heard: list[tuple[float, str]] = []
    assert poll(lambda: next(answers), 10, on_wait=lambda waited, last: heard.append((waited, last)),
                describe=lambda: "not yet", clock=clock) == 0
    assert clock.slept == [1, 2] and heard == [(0, "not yet"), (1, "not yet")]


def test_poll_counts_the_time_tries_take_against_the_deadline() -> None:
    clock = FakeClock()

    def slow() -> None:
        clock.advance(3)  # each try takes 3 s

    with pytest.raises(TimedOut) as info:
        poll(slow, 10, first_delay_s=1, max_delay_s=1, clock=clock)
    assert clock.slept == [1, 1]  # tries at 0, 4, 8; the third ends at 11
    assert info.value.waited_s == 11


def test_a_raising_attempt_stops_at_once_without_a_pause() -> None:
    clock = FakeClock()
    calls = []

    def refused() -> None:
        calls.append(1)
        raise PermissionError("key refused")

    with pytest.raises(PermissionError):
        poll(refused, 60, clock=clock)
    assert calls == [1] and clock.slept == []


def test_a_raising_on_wait_stops_the_wait_too() -> None:
    clock = FakeClock()

    def interrupted(waited_s: float, last: str) -> None:
        raise InterruptedError("Ctrl-C while it waited")

    with pytest.raises(InterruptedError):
        poll(lambda: None, 60, on_wait=interrupted, clock=clock)
    assert clock.slept == []


def test_a_timeout_shorter_than_the_first_delay_tries_once() -> None:
    clock = FakeClock()
    calls = []
    with pytest.raises(TimedOut, match=r"^timed out after 0s$"):
        poll(lambda: calls.append(1), 0.5, first_delay_s=1, clock=clock)
    assert calls == [1] and clock.slept == []


def test_backoff_resets_to_its_first_delay_and_has_no_deadline_by_default() -> None:
    clock = FakeClock()
    b = Backoff(0.1, 0.5, clock=clock)
    for _ in range(4):
        b.pause()
    b.reset()
    b.pause()
    assert clock.slept == [0.1, 0.2, 0.4, 0.5, 0.1]
    assert b.deadline == math.inf and not b.expired() and b.fits()
    fixed = Backoff(2.0, clock=clock)  # no cap given: every pause is the first
    fixed.pause()
    fixed.pause()
    assert clock.slept[-2:] == [2.0, 2.0]


def test_backoff_expires_at_its_deadline_and_a_pause_fits_only_before_it() -> None:
    clock = FakeClock()
    b = Backoff(5.0, timeout_s=10, clock=clock)
    b.pause()
    assert b.fits() and not b.expired() and b.elapsed() == 5
    b.pause()
    assert b.expired() and not b.fits()  # at the deadline itself: over


def test_the_real_clock_sleeps_really() -> None:
    start = time.monotonic()
    REAL_CLOCK.sleep(0.01)
    assert REAL_CLOCK.monotonic() - start >= 0.01


def test_an_event_clock_s_pause_ends_when_its_event_is_set() -> None:
    cancel = threading.Event()
    pausing = threading.Thread(target=EventClock(cancel).sleep, args=(3600,), daemon=True)
    pausing.start()
    cancel.set()  # a probe cancelled: its pause ends now, not at the hour
    pausing.join(30)
    assert not pausing.is_alive()


def test_wait_for_returns_the_condition_s_answer_at_once_or_names_what_it_waited_for() -> None:
    assert wait_for(lambda: "ready", timeout=5) == "ready"
    with pytest.raises(AssertionError, match="the moon not seen: timed out"):
        wait_for(lambda: None, timeout=0.01, what="the moon")
