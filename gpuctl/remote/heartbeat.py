"""gpuctl at work on a host: while a command pushes, checks, runs or follows something there, a
file under the guard's `busy/` directory is kept fresh, and the watchdog counts it as activity
(without it a 64 MB push, a preflight or `gpuctl exec -- sleep 35` looked idle and was powered off).

The watchdog trusts a file only while it is younger than STALE_S by the instance's own clock (the
file's mtime is set there): a laptop that vanishes mid-command stops counting STALE_S after its
last beat, and the idle limit runs from then. A command that ends removes its file at once.
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
import threading
from types import TracebackType
from typing import Any, Sequence

from gpuctl.payloads.gpuctl_protocol import GuardConfig
from gpuctl.remote.guard import guard_dir
from gpuctl.remote.host import Host

BUSY_DIR = "busy"
BEAT_S = 5.0
# Four beats, the watchdog's own default: a beat lost to a slow link does not make the instance look idle.
STALE_S = GuardConfig.heartbeat_stale_s


def busy_dir(host: Host) -> str:
    return posixpath.join(guard_dir(host), BUSY_DIR)


class Heartbeat:
    """Context manager: one busy file per host, touched every BEAT_S until the block ends."""

    def __init__(self, hosts: Sequence[Any], what: str):
        self.hosts = list(hosts)
        # Chosen here, never by the host: the name is a fixed word and random hex.
        self.name = f"{what}-{secrets.token_hex(6)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _path(self, host: Host) -> str:
        return posixpath.join(busy_dir(host), self.name)

    def _each(self, line: str) -> None:
        for host in self.hosts:
            try:
                host.run(["sh", "-c", line.format(path=shlex.quote(self._path(host)),
                                                  dir=shlex.quote(busy_dir(host)))], check=False)
            except Exception:  # noqa: BLE001 - a lost beat must never fail the user's command
                pass

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._each("touch {path}")

    def __enter__(self) -> "Heartbeat":
        self._each("mkdir -p {dir} && : > {path}")
        self._thread = threading.Thread(target=self._beat, name="gpuctl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=BEAT_S + 30)
        self._each("rm -f {path}")
