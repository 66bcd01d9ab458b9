"""One backoff loop for everything gpuctl waits on that has no waiter of its own (an SSH daemon
coming up, a security group freed by its instances). EC2 states use boto3's waiters instead."""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class TimedOut(Exception):
    """`poll` gave up; `last` says what the final try saw."""

    def __init__(self, waited_s: float, last: str):
        super().__init__(f"timed out after {waited_s:.0f}s ({last})" if last else f"timed out after {waited_s:.0f}s")
        self.waited_s = waited_s
        self.last = last


def poll(attempt: Callable[[], Optional[T]], timeout_s: float, first_delay_s: float = 1.0, max_delay_s: float = 10.0,
         on_wait: Callable[[float, str], None] | None = None, describe: Callable[[], str] = lambda: "") -> T:
    """Call `attempt` until it returns something other than None, sleeping 1, 2, 4 .. max_delay_s
    seconds between tries, for at most `timeout_s`. `attempt` raises to stop at once (a final
    answer such as a refused key); `on_wait(elapsed_s, last)` hears each wait."""
    start = time.monotonic()
    deadline = start + timeout_s
    delay = first_delay_s
    while True:
        result = attempt()
        if result is not None:
            return result
        last = describe()
        if time.monotonic() + delay > deadline:
            raise TimedOut(time.monotonic() - start, last)
        if on_wait:
            on_wait(time.monotonic() - start, last)
        time.sleep(delay)
        delay = min(delay * 2, max_delay_s)
