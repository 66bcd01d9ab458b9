"""A pinned TensorFlow on a host: find it, or have the setup payload (gpuctl_setup.py) make it.

The install runs detached on the host (setsid, its own log), not inside this SSH session: a
laptop that closes half-way leaves an install that finishes by itself, and the next `train`
finds it ready (or waits for it). This side starts it and follows its log.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import time
from typing import Any, Callable

from gpuctl.errors import RemoteError
from gpuctl.remote.host import Host
from gpuctl.remote.jobs import MARK_VAR

SETUP = "gpuctl_setup.py"
STEP = "gpuctl-setup: "
POLL_S = 2.0
INSTALL_TIMEOUT_S = 3600.0  # tensorflow[and-cuda] is ~3 GB of wheels; a slow mirror takes long


def _payload(payload_dir: str, command: str, root: str, version: str, *extra: str) -> list[str]:
    return ["python3", posixpath.join(payload_dir, SETUP), command, "--root", root, "--tensorflow", version, *extra]


def _no_python3(host: Host) -> RemoteError:
    return RemoteError(f"no python3 on {host.label} to set TensorFlow up with",
                       "Install it there (`sudo apt-get install python3 python3-venv`), or set `remote.python` "
                       "to an interpreter that has TensorFlow.")


def probe(host: Host, payload_dir: str, root: str, version: str) -> dict[str, Any]:
    """What the host has: gpuctl's env for `version` (ready or being made), other Pythons with it."""
    res = host.run(_payload(payload_dir, "probe", root, version), check=False, timeout=300)
    if res.returncode == 127:
        raise _no_python3(host)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(f"the setup probe failed on {host.label}: {(res.stderr or res.stdout).strip()[-300:]}",
                          "Check that python3 runs there, or set `remote.python`.") from None


def start_install(host: Host, payload_dir: str, root: str, version: str, wheelhouse: str = "") -> int:
    """Start the install in the background on the host; its pid. It carries the cluster's process
    mark, so `down` of an ssh cluster ends it with the cluster's jobs."""
    argv = _payload(payload_dir, "install", root, version, *(["--wheelhouse", wheelhouse] if wheelhouse else []))
    script = (f"cd / && {MARK_VAR}={shlex.quote(host.tmux_socket)} setsid nohup {shlex.join(argv)} "
              "</dev/null >/dev/null 2>&1 & echo $!")
    res = host.run(["sh", "-c", script], timeout=60)
    try:
        return int(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(f"could not start the setup step on {host.label}: {res.stderr.strip()[-300:]}") from None


def follow(host: Host, where: dict[str, Any], pid: int, progress: Callable[[str], None],
           timeout_s: float = INSTALL_TIMEOUT_S) -> dict[str, Any]:
    """Relay the install's steps (its log from where the probe left it) until it writes its result.
    An install of another command that holds the env's lock makes this one wait, then find the
    env ready: either way the result is this pid's."""
    offset = int(where.get("log_size") or 0)
    deadline = time.monotonic() + timeout_s
    looked = time.monotonic()
    while True:
        chunk = host.read_bytes(where["log"], offset) or b""
        complete = chunk[: chunk.rfind(b"\n") + 1]  # half a line waits for the next look
        offset += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            if line.startswith(STEP):
                progress(f"setup on {host.label}: {line[len(STEP):]}")
        result = _result(host, where["result"])
        if result and result.get("pid") == pid:
            return result
        if time.monotonic() > deadline:
            raise RemoteError(f"the setup step on {host.label} is still running after {timeout_s / 60:.0f} min",
                              "It goes on there: `gpuctl logs --setup` shows it; train again once it is ready.")
        if time.monotonic() - looked > 10:
            looked = time.monotonic()
            if host.run(["kill", "-0", str(pid)], check=False).returncode != 0:
                result = _result(host, where["result"])  # it may have ended between the two looks
                if result and result.get("pid") == pid:
                    return result
                raise RemoteError(f"the setup step on {host.label} ended without a result (killed?)",
                                  "See `gpuctl logs --setup`; `gpuctl train` again starts it anew.")
        time.sleep(POLL_S)


def _result(host: Host, path: str) -> dict[str, Any] | None:
    raw = host.read_bytes(path)
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None  # the instance's file: trust its shape no further


def setup_log(host: Host, payload_dir: str, root: str, version: str) -> str:
    """The whole install log (what pip said, each attempt)."""
    res = host.run(_payload(payload_dir, "log", root, version), check=False)
    if res.returncode == 127:
        raise _no_python3(host)
    if res.returncode != 0:
        raise RemoteError(f"no setup log for TensorFlow {version} on {host.label}",
                          "gpuctl set nothing up there: it uses remote.python, an image with TensorFlow, or "
                          "has not trained yet.")
    return res.stdout
