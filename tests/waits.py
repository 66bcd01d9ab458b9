"""Waiting in tests: a clock the tests drive (gpuctl.retry's waits take no real time on it), and
wait_for, which waits on a condition rather than for a while."""

from __future__ import annotations

from typing import Callable, TypeVar

from gpuctl.retry import TimedOut, poll

T = TypeVar("T")


class FakeClock:
    """gpuctl.retry.Clock whose sleep advances its time at once, and keeps what it was asked to
    sleep; `on_sleep(clock)` runs after each (a test makes something happen at a given moment)."""

    def __init__(self, start: float = 1000.0, on_sleep: Callable[[FakeClock], None] | None = None):
        self.now = start
        self.slept: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.slept.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(self)

    def advance(self, seconds: float) -> None:
        """Time passes without a sleep (an attempt that took this long)."""
        self.now += seconds


def wait_for(cond: Callable[[], T | None], timeout: float = 60.0, what: str = "the condition", every: float = 0.2) -> T:
    """`cond()`'s first truthy answer, looked for at once, then after 0.02 s, doubling to `every`
    (it returns as soon as the condition holds, so `timeout` is generous); AssertionError naming
    `what` after `timeout`. gpuctl's own poll on the real clock: the tests' one wait loop."""

    def attempt() -> T | None:
        return cond() or None

    try:
        return poll(attempt, timeout, first_delay_s=min(0.02, every), max_delay_s=every)
    except TimedOut as exc:
        raise AssertionError(f"{what} not seen: {exc}") from None
