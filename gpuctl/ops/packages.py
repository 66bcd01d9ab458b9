"""A project's packages: its requirements.txt (or `train.requirements`) installed on each node into
a venv layered on the TensorFlow environment its runs use (payloads/gpuctl_packages.py), made
once per file and Python and kept for the next run, the next cluster on that host, or the next
`train` on a new instance (which makes it once). A project without the file runs with the plain
TensorFlow environment: it never sees another project's packages.

The venv is WORKDIR/_envs/req-HASH-KEY (HASH: sha256 of the file's bytes, KEY: of the Python it
layers on), next to the setup step's tf-VERSION envs.
"""

from __future__ import annotations

import hashlib
import posixpath
import time
from pathlib import Path
from typing import Any

from gpuctl.config.load import LoadedSettings
from gpuctl.errors import ConfigError, ProjectError, RemoteError
from gpuctl.model import untrusted
from gpuctl.ops import guards
from gpuctl.ops.session import Progress, Session
from gpuctl.payloads.gpuctl_packages import MAX_FILE
from gpuctl.remote import tf_env
from gpuctl.remote.host import Host
from gpuctl.remote.jobs import start_detached

PAYLOAD = "gpuctl_packages.py"
DEFAULT = "requirements.txt"


def requirements_of(loaded: LoadedSettings, project: Path) -> tuple[str, bytes] | None:
    """(its name in the project, its bytes) of the project's requirements file; None: it has none
    (only the default name may be missing)."""
    name = loaded.settings.train.requirements or DEFAULT
    path = (project / name).resolve()
    if not path.is_relative_to(project.resolve()):
        raise ConfigError(f"train.requirements = {name!r} is outside the project {project}",
                          "Name a file inside the project (it goes to every node), e.g. requirements.txt.")
    if not path.is_file():
        if loaded.settings.train.requirements:
            raise ConfigError(f"train.requirements = {name!r}: no such file in {project}",
                              "Name the project's requirements file, or leave the setting out.")
        return None
    return name, _bounded(path, name)


def requirements_file(path: Path) -> tuple[str, bytes]:
    """(its name, its bytes) of a requirements file named directly (`image bake --requirements`)."""
    if not path.is_file():
        raise ConfigError(f"no requirements file {str(path)!r}",
                          "Name a pip requirements file, e.g. --requirements project/requirements.txt.")
    return path.name, _bounded(path, str(path))


def _bounded(path: Path, name: str) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise ProjectError(f"{name} is over {MAX_FILE >> 10} KiB", "List the packages the script imports.")
    return data


def label(name: str, data: bytes) -> str:
    """How a run, `status` and an image name the file: "requirements.txt (sha256 1a2b3c4d)"."""
    return f"{name} (sha256 {hashlib.sha256(data).hexdigest()[:8]})"


def env_dir(host: Host, python: str, data: bytes) -> str:
    """The layered venv of this file over this Python on the host (beside the setup step's envs)."""
    key = hashlib.sha256(python.encode()).hexdigest()[:8]
    return posixpath.join(posixpath.dirname(host.root), "_envs",
                          f"req-{hashlib.sha256(data).hexdigest()[:16]}-{key}")


def ensure(s: Session, host: Host, python: str, name: str, data: bytes, wheelhouse: str,
           progress: Progress) -> tuple[str, float]:
    """The layered venv's Python for this file on this host, made if need be; the seconds its
    install took (0: made before). Refused (nothing made) where a line would replace TensorFlow."""
    payload = posixpath.join(guards.push_payload(host, s.facts(host)), PAYLOAD)
    env = env_dir(host, python, data)
    reqs = env + ".txt"
    host.write_bytes(reqs, data)  # named by its hash: another command writes the same bytes
    argv = [python, payload, "probe", "--env", env, "--requirements", reqs]
    seen = _probe(host, argv, name)
    for note in seen["notes"]:
        progress(f"packages on {host.label}: {name} {note}")
    if seen["refused"]:
        raise ProjectError(f"{name} {seen['refused']}",
                           "TensorFlow and its Keras come from the cluster (`up --tf`, train.tensorflow): drop the "
                           "line, or make it match the version there.")
    python_there = posixpath.join(env, "bin", "python")
    if seen["ready"]:
        progress(f"packages on {host.label}: {name} ready in {env}")
        return python_there, 0.0
    progress(f"packages on {host.label}: installing {seen['count']} requirement(s) of {name} into {env}")
    started = time.monotonic()
    pid = start_detached(host, [python, payload, "install", "--env", env, "--requirements", reqs,
                                *(["--wheelhouse", wheelhouse] if wheelhouse else [])], "the packages' install")
    result = tf_env.follow(host, {"env": env, "log": env + ".log", "log_size": seen["log_size"]}, pid, progress,
                           name="packages")
    if not result["ok"]:
        raise RemoteError(f"installing {name} failed on {host.label}: {result['error']}",
                          f"pip's whole output is in {env}.log there (`gpuctl exec -- tail -50 {env}.log`); fix "
                          f"the line it names, or give offline hosts the wheels (remote.wheelhouse).")
    return python_there, round(time.monotonic() - started, 1)


def _probe(host: Host, argv: list[str], name: str) -> dict[str, Any]:
    res = host.run(argv, check=False, timeout=120)
    try:
        seen = untrusted.loads(res.stdout.strip().splitlines()[-1])
    except (untrusted.Untrusted, IndexError):
        seen = None
    if not isinstance(seen, dict) or not isinstance(seen.get("log_size"), int) or \
            not isinstance(seen.get("notes"), list) or not isinstance(seen.get("count"), int):
        raise RemoteError(f"could not check {name} on {host.label}: {(res.stderr or res.stdout).strip()[-300:]}",
                          "Check that the cluster's Python runs there (`gpuctl exec -- python3 -V`).")
    refused = seen.get("refused")
    return {"refused": untrusted.one_line(refused, 400) if refused else None, "ready": seen.get("ready") is True,
            "notes": [untrusted.one_line(n, 200) for n in seen["notes"][:20]], "count": seen["count"],
            "log_size": max(seen["log_size"], 0)}
