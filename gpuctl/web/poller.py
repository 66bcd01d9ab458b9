"""The dashboard's one poller: a thread that looks (ops/dashboard.look) every `interval_s` and
keeps the latest answer, rendered once, for every tab; so many tabs cost the instances no more SSH
looks than one."""

from __future__ import annotations

import threading
import time
from typing import Callable

from gpuctl.errors import GpuctlError
from gpuctl.model.untrusted import one_line
from gpuctl.ops import dashboard
from gpuctl.ops.session import Session

# A session keeps its SSH connections between looks; renewed this often (and after an error) so
# that what it learnt once per command (a host that did not answer) is asked again.
SESSION_S = 30.0


class Poller:
    def __init__(self, open_session: Callable[[], Session], interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.open_session, self.interval_s, self.clock = open_session, interval_s, clock
        self.lock = threading.Lock()  # the published data
        self.version = 0  # bumped when what the page shows changed
        self.view_json = b""
        self.details: dict[str, bytes] = {}
        self.default_run = ""  # the run a page shows first: the newest running one, else the newest
        self.error: tuple[str, str] | None = None  # the last look's Error and Hint, until one succeeds
        self.looks = 0  # done
        self.started = 0  # begun (looks are one at a time: look k is done when looks == k)
        self._digest = b""
        self.looker = dashboard.Looker()  # the poller thread's alone
        self._stop = threading.Event()
        self._wake = threading.Event()  # a poke: look now
        self._looked = threading.Condition()  # notified after each look
        self._session: Session | None = None
        self._session_at = 0.0
        self._thread = threading.Thread(target=self._loop, name="gpuctl-dashboard-poller", daemon=True)

    def start(self, first_within_s: float = 60.0) -> None:
        """Start looking; returns after the first look (or `first_within_s`), so the first page has
        something to show. Only the poller's thread touches its session (SQLite's rule, and SSH's)."""
        self._thread.start()
        self._wait_for(0, first_within_s)

    def close(self, wait_s: float = 30.0) -> None:
        """End the looks; waits `wait_s` for one under way (the thread is a daemon: a look stuck
        on a host ends with the process)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=wait_s)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the look: a poke during it asks for the next one
                self.poll()
                self._wake.wait(self.interval_s)
        finally:
            self._drop_session()

    def _wait_for(self, looks: int, timeout_s: float) -> None:
        with self._looked:
            self._looked.wait_for(lambda: self.looks > looks or not self._thread.is_alive(), timeout_s)

    def _drop_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _current(self) -> Session:
        if self._session is None or time.monotonic() - self._session_at > SESSION_S:
            self._drop_session()
            self._session, self._session_at = self.open_session(), time.monotonic()
        return self._session

    def poll(self) -> None:
        """One look (on the poller's thread); the page's data replaced when it changed."""
        self._poll()
        with self._looked:
            self._looked.notify_all()

    def _poll(self) -> None:
        with self.lock:
            self.started += 1
        try:
            looked = self.looker.look(self._current(), self.clock())
        except GpuctlError as exc:
            self._drop_session()
            self._set_error((one_line(exc.message), one_line(exc.hint)))
            return
        except Exception as exc:  # noqa: BLE001 - the page says it; the next look tries again
            self._drop_session()
            self._set_error((one_line(f"{type(exc).__name__}: {exc}"), "See the terminal that runs `gpuctl dashboard`."))
            return
        self._publish(looked)

    def _set_error(self, error: tuple[str, str]) -> None:
        with self.lock:
            self.looks += 1
            if error != self.error:
                self.error = error
                self.version += 1

    def _publish(self, looked: dashboard.Looked) -> None:
        with self.lock:
            self.looks += 1
            self.view_json, self.details, self.default_run = looked.view, looked.details, looked.default_run
            changed = looked.digest != self._digest or self.error is not None
            self.error = None
            self._digest = looked.digest
            if changed:
                self.version += 1

    def poke(self, within_s: float = 30.0) -> None:
        """Look now (after the page acted), not at the next tick; returns once that look is done."""
        with self.lock:
            started = self.started  # a look under way may have begun before the act: the next one counts
        self._wake.set()
        self._wait_for(started, within_s)
