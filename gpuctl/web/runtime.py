"""Serving the dashboard: a loopback socket, uvicorn on it, and the files by which a second
`gpuctl dashboard` finds the first: the gpuctl home's dashboard.lock (held while one serves) and
dashboard.json (its port and token, mode 0600, as Jupyter keeps its servers' tokens in a private
runtime file; never the ledger, never a log)."""

from __future__ import annotations

import errno
import fcntl
import http.client
import json
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import IO, Callable

from gpuctl.errors import ConflictError
from gpuctl.files import write_private
from gpuctl.ops import browser
from gpuctl.web.poller import Poller
from gpuctl.web.server import Act, Ask, make_app

RUNTIME_FILE = "dashboard.json"
LOCK_FILE = "dashboard.lock"
OPEN_FILE = "dashboard-open.html"  # what the browser is given: a file that redirects (no token in argv)
MAX_RUNTIME_BYTES = 4096
HOST = "127.0.0.1"
FIRST_LOOK_S = 60.0  # how long a second dashboard waits for a starting one's URL


def url(port: int, token: str) -> str:
    # The token in the fragment: the browser never sends it to a server (nor in a Referer).
    return f"http://{HOST}:{port}/#token={token}"


def running(home: Path, timeout_s: float = 2.0) -> str | None:
    """The URL of a dashboard this home already serves (it answered with its token), else None."""
    try:
        with (home / RUNTIME_FILE).open("rb") as f:
            found = json.loads(f.read(MAX_RUNTIME_BYTES))
        port, token = int(found["port"]), str(found["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 < port < 65536:
        return None
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("GET", "/api/view", headers={"Authorization": f"Bearer {token}", "Host": f"{HOST}:{port}"})
        ok = conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return url(port, token) if ok else None


def claim(home: Path) -> IO[bytes] | None:
    """This home's dashboard lock, held until the returned file is closed; None: another
    dashboard of this home holds it (it serves, or is starting)."""
    home.mkdir(parents=True, exist_ok=True)
    f = open(home / LOCK_FILE, "ab")  # noqa: SIM115 - held for the dashboard's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def wait_for_other(home: Path) -> str:
    """The URL of the dashboard that holds the lock (it may be in its first look)."""
    deadline = time.monotonic() + FIRST_LOOK_S
    while time.monotonic() < deadline:
        found = running(home)
        if found is not None:
            return found
        time.sleep(0.5)
    raise ConflictError("another `gpuctl dashboard` of this gpuctl home holds its lock but does not answer",
                        f"End it (its pid holds {home / LOCK_FILE}: `fuser {home / LOCK_FILE}`), then run this again.")


def listen(port: int) -> socket.socket:
    """A socket on the loopback address (port 0: a free one); a port in use is a one-line error."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConflictError(f"port {port} on {HOST} is in use",
                                "Pass another --port, or leave --port out to take a free one.") from None
        raise
    sock.listen(64)
    return sock


def opener(home: Path, address: str) -> str:
    """A file:// page that sends the browser on to `address`: the browser's command line then
    carries no token (other users see command lines)."""
    return browser.opener(home, OPEN_FILE, address, "the gpuctl dashboard")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(home: Path, sock: socket.socket, poller: Poller, acts: dict[str, Act], ask: Ask,
          ready: Callable[[str], None]) -> None:
    """Serve until Ctrl-C, SIGTERM or SIGHUP; `ready(url)` once it listens. The runtime files go
    first when it ends (then the poller, which may be in a look)."""
    import uvicorn

    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(32)
    app = make_app(poller, token, port, acts, ask)
    # No access log: nothing of a request is kept.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    runtime = home / RUNTIME_FILE
    # uvicorn ends on SIGINT and SIGTERM, then raises the signal again to the handler it found:
    # SIGTERM's default would end the process before the runtime file is removed. Each of them
    # (and SIGHUP: a closed terminal) ends the serving here, as Ctrl-C does.
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        poller.start()
        write_private(runtime, json.dumps({"pid": os.getpid(), "port": port, "token": token}))
        ready(url(port, token))
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # Ctrl-C is how it ends
    finally:
        for path in (runtime, home / OPEN_FILE):
            try:
                path.unlink()
            except OSError:
                pass
        for sig, handler in before.items():
            signal.signal(sig, handler)
        poller.close(wait_s=5)
