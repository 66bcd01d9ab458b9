"""A pinned TensorFlow on a host: find it, or have the setup payload (gpuctl_setup.py) make it.

The install runs detached on the host (setsid, its own log), not inside this SSH session: a
laptop that closes half-way leaves an install that finishes by itself, and the next `train`
finds it ready (or waits for it). This side starts it and follows its log.
"""

from __future__ import annotations

import posixpath
from typing import Any, Callable, TypeGuard

from gpuctl.errors import RemoteError
from gpuctl.model import untrusted
from gpuctl.remote.host import Host
from gpuctl.remote.jobs import start_detached
from gpuctl.retry import REAL_CLOCK, Backoff, Clock

SETUP = "gpuctl_setup.py"
STEP = "gpuctl-setup: "
POLL_S = 2.0
ALIVE_LOOK_S = 10.0  # how often a followed install is asked whether it still runs
INSTALL_TIMEOUT_S = 3600.0  # tensorflow[and-cuda] is ~3 GB of wheels; a slow mirror takes long


def _payload(payload_dir: str, command: str, root: str, version: str, *extra: str) -> list[str]:
    return ["python3", posixpath.join(payload_dir, SETUP), command, "--root", root, "--tensorflow", version, *extra]


def _no_python3(host: Host) -> RemoteError:
    return RemoteError(f"no python3 on {host.label} to set TensorFlow up with",
                       "Install it there (`sudo apt-get install python3 python3-venv`), or set `remote.python` "
                       "to an interpreter that has TensorFlow.")


def probe(host: Host, payload_dir: str, root: str, version: str) -> dict[str, Any]:
    """What the host has: gpuctl's env for `version` (ready or being made), other Pythons with it.
    The answer is the instance's: checked for shape and for paths where gpuctl's own must be."""
    res = host.run(_payload(payload_dir, "probe", root, version), check=False, timeout=300)
    if res.returncode == 127:
        raise _no_python3(host)
    try:
        where = untrusted.loads(res.stdout.strip().splitlines()[-1])
    except (untrusted.Untrusted, IndexError):
        raise RemoteError(f"the setup probe failed on {host.label}: {(res.stderr or res.stdout).strip()[-300:]}",
                          "Check that python3 runs there, or set `remote.python`.") from None
    problem = _unreadable(where, version)
    if problem:
        raise RemoteError(f"the setup probe on {host.label} answered what gpuctl cannot use ({problem})",
                          "Check the host's python3 and gpuctl's work dir there, or set `remote.python`.")
    checked: dict[str, Any] = where  # _unreadable found it an object of the shape described
    return checked


def _path(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and value.startswith("/") and value.isprintable()


def _unreadable(where: Any, version: str) -> str | None:
    """Why the probe's answer cannot be used, or None."""
    if not isinstance(where, dict):
        return "not an object"
    env = where.get("env")
    if not _path(env) or not env.endswith(f"/_envs/tf-{version}"):
        return "env"
    envs = posixpath.dirname(env)
    python = where.get("python")
    if not _path(python) or not (python.startswith(envs + "/tf-") and python.endswith("/bin/python")):
        return "python"
    if where.get("log") != env + ".log" or not isinstance(where.get("log_size"), int) or where["log_size"] < 0:
        return "log"
    if where.get("ready") is not None and not (isinstance(where["ready"], dict) and _text(where["ready"].get("tensorflow"))):
        return "ready"
    for key in ("found", "others"):
        items = where.get(key)
        if not isinstance(items, list) or not all(
                isinstance(i, dict) and _path(i.get("python")) and (i.get("tensorflow") is None or _text(i["tensorflow"]))
                for i in items):
            return key
    if not _text(where.get("system_version")):
        return "system_version"
    return None


def _text(value: object) -> TypeGuard[str]:
    """A short printable string: it goes to the user's terminal (no escape sequences)."""
    return isinstance(value, str) and len(value) <= 64 and value.isprintable()


def start_install(host: Host, payload_dir: str, root: str, version: str, wheelhouse: str = "") -> int:
    """Start the install in the background on the host; its pid. It carries the cluster's process
    mark, so `down` of an ssh cluster ends it with the cluster's jobs."""
    argv = _payload(payload_dir, "install", root, version, *(["--wheelhouse", wheelhouse] if wheelhouse else []))
    return start_detached(host, argv, "the setup step")


def follow(host: Host, where: dict[str, Any], pid: int, progress: Callable[[str], None],
           timeout_s: float = INSTALL_TIMEOUT_S, clock: Clock = REAL_CLOCK, name: str = "setup") -> dict[str, Any]:
    """Relay the install's steps (its log from where the probe left it) until it writes its result.
    An install of another command that holds the env's lock makes this one wait, then find the
    env ready: either way the result is this pid's. `name`: whose install (the project's packages
    follow theirs here too, ops/packages.py)."""
    hint = "`gpuctl logs --setup`" if name == "setup" else f"{where['log']} there"
    offset = where["log_size"]
    result_path = f"{where['env']}.result.{pid}.json"
    pauses = Backoff(POLL_S, timeout_s=timeout_s, clock=clock)
    looked = pauses.elapsed()
    while True:
        chunk = host.read_bytes(where["log"], offset) or b""
        complete = chunk[: chunk.rfind(b"\n") + 1]  # half a line waits for the next look
        offset += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            if line.startswith(STEP):
                progress(f"{name} on {host.label}: {line[len(STEP):]}")
        result = _result(host, result_path)
        if result is not None:
            host.run(["rm", "-f", result_path], check=False)  # read: one file per install, none left over
            return result
        if pauses.expired():
            raise RemoteError(f"the {name} step on {host.label} is still running after {timeout_s / 60:.0f} min",
                              f"It goes on there: {hint} shows it; train again once it is ready.")
        if pauses.elapsed() - looked > ALIVE_LOOK_S:
            looked = pauses.elapsed()
            if host.run(["kill", "-0", str(pid)], check=False).returncode != 0:
                result = _result(host, result_path)  # it may have ended between the two looks
                if result is not None:
                    return result
                raise RemoteError(f"the {name} step on {host.label} ended without a result (killed?)",
                                  f"See {hint}; `gpuctl train` again starts it anew.")
        pauses.pause()


def _result(host: Host, path: str) -> dict[str, Any] | None:
    """The install's result, once whole; only its plain fields, checked (it is the instance's file)."""
    raw = host.read_bytes(path, 0, untrusted.MAX_JSON + 1)
    try:
        data = untrusted.loads(raw) if raw else None
    except untrusted.Untrusted:
        return None  # being written (it is renamed into place, so only a foreign file is torn)
    if not isinstance(data, dict):
        return None
    version = data.get("tensorflow")
    return {"ok": data.get("ok") is True, "skipped": data.get("skipped") is True,
            "tensorflow": version if isinstance(version, str) and version.isprintable() else None,
            "python": data.get("python") if _path(data.get("python")) else None,
            "error": str(data.get("error"))[:300] if data.get("error") else None}


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
