"""The one backoff for everything gpuctl waits on that has no waiter of its own (an SSH daemon
coming up, a security group freed by its instances, a job's grace after SIGTERM, a followed log).
EC2 states use boto3's waiters instead (provision/aws/session.py's `wait_for`).

Every pause goes through a Clock, so that a test drives time (tests/waits.py's FakeClock) instead
of sleeping through it."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Optional, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    """Time as a wait sees it: a monotonic reading and a pause."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


REAL_CLOCK: Clock = RealClock()


class EventClock(RealClock):
    """The real clock, whose sleep ends early once `event` is set (a wait that a cancel ends)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def sleep(self, seconds: float) -> None:
        self.event.wait(seconds)


class TimedOut(Exception):
    """`poll` gave up; `last` says what the final try saw."""

    def __init__(self, waited_s: float, last: str):
        super().__init__(f"timed out after {waited_s:.0f}s ({last})" if last else f"timed out after {waited_s:.0f}s")
        self.waited_s = waited_s
        self.last = last


class Backoff:
    """Pauses of `first_delay_s`, doubling up to `max_delay_s` (the first again after `reset`),
    on `clock`, within `timeout_s` of its making (inf: no deadline). A loop that does more than
    try one thing (a followed log, a grace that ends early) paces itself with one; `poll` is the
    common loop built on it."""

    def __init__(self, first_delay_s: float, max_delay_s: float | None = None, timeout_s: float = math.inf,
                 clock: Clock = REAL_CLOCK):
        self.clock = clock
        self.first_delay_s = first_delay_s
        self.max_delay_s = first_delay_s if max_delay_s is None else max_delay_s
        self.delay = first_delay_s  # the next pause
        self.started = clock.monotonic()
        self.deadline = self.started + timeout_s

    def elapsed(self) -> float:
        return self.clock.monotonic() - self.started

    def expired(self) -> bool:
        """The deadline has come."""
        return self.clock.monotonic() >= self.deadline

    def fits(self) -> bool:
        """The next pause ends before the deadline."""
        return self.clock.monotonic() + self.delay <= self.deadline

    def pause(self) -> None:
        """Sleep the next pause; the one after is twice as long (up to the cap)."""
        self.clock.sleep(self.delay)
        self.delay = min(self.delay * 2, self.max_delay_s)

    def reset(self) -> None:
        """Something happened: the next pause is the first one again."""
        self.delay = self.first_delay_s


def poll(attempt: Callable[[], Optional[T]], timeout_s: float, first_delay_s: float = 1.0, max_delay_s: float = 10.0,
         on_wait: Callable[[float, str], None] | None = None, describe: Callable[[], str] = lambda: "",
         clock: Clock = REAL_CLOCK) -> T:
    """Call `attempt` until it returns something other than None, sleeping 1, 2, 4 .. max_delay_s
    seconds between tries, for at most `timeout_s` (no try is made after it: a pause that would
    pass it gives up first). `attempt` raises to stop at once (a final answer such as a refused
    key); `on_wait(elapsed_s, last)` hears each wait."""
    backoff = Backoff(first_delay_s, max_delay_s, timeout_s, clock)
    while True:
        result = attempt()
        if result is not None:
            return result
        last = describe()
        if not backoff.fits():
            raise TimedOut(backoff.elapsed(), last)
        if on_wait:
            on_wait(backoff.elapsed(), last)
        backoff.pause()
