"""Serving the dashboard: a loopback socket, uvicorn on it, and the file by which a second
`gpuctl dashboard` finds the first (the gpuctl home's dashboard.json, mode 0600, as Jupyter keeps
its servers' tokens in a private runtime file; never the ledger, never a log)."""

from __future__ import annotations

import errno
import http.client
import json
import os
import secrets
import signal
import socket
from pathlib import Path
from typing import Callable

from gpuctl.errors import ConflictError
from gpuctl.web.poller import Poller
from gpuctl.web.server import COOKIE, Act, make_app

RUNTIME_FILE = "dashboard.json"
MAX_RUNTIME_BYTES = 4096
HOST = "127.0.0.1"


def url(port: int, token: str) -> str:
    return f"http://{HOST}:{port}/?token={token}"


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
        conn.request("GET", "/api/view", headers={"Cookie": f"{COOKIE}={token}", "Host": f"{HOST}:{port}"})
        ok = conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return url(port, token) if ok else None


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


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(home: Path, sock: socket.socket, poller: Poller, acts: dict[str, Act],
          ready: Callable[[str], None]) -> None:
    """Serve until Ctrl-C (or SIGTERM); `ready(url)` once it listens. The runtime file goes with it."""
    import uvicorn

    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(32)
    app = make_app(poller, token, port, acts)
    # No access log: the first request carries the token in its URL.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    runtime = home / RUNTIME_FILE
    home.mkdir(parents=True, exist_ok=True)
    poller.start()
    # uvicorn ends on SIGINT and SIGTERM, then raises the signal again to the handler it found:
    # SIGTERM's default would end the process before the runtime file is removed. Each of them
    # (and SIGHUP: a closed terminal) ends the serving here, as Ctrl-C does.
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _write_private(runtime, json.dumps({"pid": os.getpid(), "port": port, "token": token}))
        ready(url(port, token))
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # Ctrl-C is how it ends
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        poller.close()
        try:
            if json.loads(runtime.read_text()).get("pid") == os.getpid():
                runtime.unlink()
        except (OSError, ValueError):
            pass
