"""A project and its data on the way to a host: the checks made before anything is pushed or
launched (a project directory with its entry point, a data directory), and the pushes themselves.

Each directory is pushed to its own place on the host, code/NAME-ID or data/NAME-ID, where ID
says where it comes from (this machine and its real path: `place`): two directories of one name
from different places never share files or delete each other's, and one pushed again finds its
earlier push (only what changed is sent). A run then gets its own copy (`submit`): the pushed
tree linked into its run directory (RUN/code, RUN/data), file by file as hard links, so a later
push of the same project or data, edited, never changes a run already submitted, and the copy
goes with the run (`runs rm`, or the cluster's files)."""

from __future__ import annotations

import hashlib
import posixpath
import re
import socket
from pathlib import Path

from gpuctl.config.load import LoadedSettings
from gpuctl.errors import ProjectError
from gpuctl.model.records import SyncStats
from gpuctl.ops.session import Progress, Session
from gpuctl.payloads.gpuctl_protocol import RUN_DATA_DIR
from gpuctl.remote.host import Host
from gpuctl.remote.sync.private import Private


def slug(text: str) -> str:
    """A name for directories and run ids: letters, digits, - and _, at most 24 characters."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:24] or "run"


def project_dir(project: Path) -> Path:
    """The project directory, resolved; ProjectError when there is none."""
    project = Path(project)
    if not project.is_dir():
        raise ProjectError(
            f"project directory {str(project)!r} does not exist" if not project.exists()
            else f"{str(project)!r} is not a directory",
            "Pass the directory that holds your training script, e.g. `gpuctl train examples/cifar10`.",
        )
    return project.resolve()


def check_project(s: Session, project: Path) -> tuple[Path, LoadedSettings, str]:
    """(the project's resolved path, the settings for it, its entry point), or the ProjectError
    that says what is missing, before anything is pushed or launched."""
    project = project_dir(project)
    Private().check_root(str(project))  # before its settings are read, or anything made
    loaded = s.settings(project_dir=project)
    entry = loaded.settings.train.entry
    if not (project / entry).is_file():
        raise ProjectError(f"no entry point: {project / entry} does not exist",
                           f"Add {entry} to the project, or set `[train] entry = \"your_script.py\"` in its "
                           "gpuctl.toml (or pass --entry).")
    if not (project / entry).resolve().is_relative_to(project):
        # The push leaves out links that lead out of the project: the job could only fail.
        raise ProjectError(f"the entry point {entry} is a link to a file outside the project",
                           "Copy the script into the project (gpuctl pushes only what is inside it).")
    return project, loaded, entry


def check_data(data: Path | None) -> Path | None:
    """The data directory, resolved (None: no data); ProjectError when it is not one."""
    if data is None:
        return None
    if not Path(data).is_dir():
        raise ProjectError(f"data directory {str(data)!r} " + ("is a file, not a directory" if Path(data).exists()
                                                              else "does not exist"),
                           "Pass --data DIR with a directory of training data, or leave it out.")
    Private().check_root(str(Path(data).resolve()))
    return Path(data).resolve()


def place(path: Path) -> str:
    """A directory's place on a host below code/ or data/: its name, readable, then 8 hex of
    where it comes from (this machine's name and the directory's real path)."""
    origin = f"{socket.gethostname()}\0{Path(path).resolve()}"
    return f"{slug(Path(path).name)}-{hashlib.sha256(origin.encode()).hexdigest()[:8]}"


def push_code(host: Host, project: Path, progress: Progress) -> tuple[SyncStats, str]:
    """Push the project's code to its place on the host (code/NAME-ID); (stats, that dir)."""
    code_dir = posixpath.join(host.root, "code", place(project))
    return host.push(project, code_dir, progress=lambda line: progress(f"code: {line}")), code_dir


def push_data(host: Host, data: Path, progress: Progress) -> tuple[SyncStats, str]:
    """Push a data directory to its place on the host (data/NAME-ID); (stats, that dir)."""
    data_dir = posixpath.join(host.root, "data", place(data))
    return host.push(data, data_dir, progress=lambda line: progress(f"data: {line}")), data_dir


def submit(host: Host, run_dir: str, code_dir: str, data_dir: str | None, copies: str | None = None
           ) -> tuple[str, str | None]:
    """The run's own copies of the pushed code (and data), linked into its directory: (RUN/code,
    RUN/data). Called right after the push, before the run is queued or started. `copies`: the
    data's copy goes there instead (COPIES/RUN_ID), on the filesystem the data is on (a volume:
    hard links do not cross to the instance's disk); copies there of runs this host does not
    have (a released cluster's) go first."""
    own_code = posixpath.join(run_dir, "code")
    host.link_tree(code_dir, own_code)
    if data_dir is None:
        return own_code, None
    own_data = posixpath.join(run_dir, RUN_DATA_DIR)
    if copies is not None:
        _prune_copies(host, copies, posixpath.dirname(run_dir))
        own_data = posixpath.join(copies, posixpath.basename(run_dir))
    host.link_tree(data_dir, own_data)
    return own_code, own_data


def _prune_copies(host: Host, copies: str, runs_dir: str) -> None:
    """Remove the run copies under `copies` whose run directory is not in `runs_dir` here."""
    script = ('for d in "$1"/*/; do [ -d "$d" ] || continue; n=$(basename "$d"); '
              '[ -d "$2/$n" ] || rm -rf -- "$d"; done')
    host.run(["sh", "-c", script, "prune", copies, runs_dir], check=False)


def push_all(host: Host, project: Path, data: Path | None, progress: Progress
             ) -> tuple[SyncStats, SyncStats | None, str, str | None]:
    """Push code and (separately, so a code push never touches it) data; their remote dirs."""
    code, code_dir = push_code(host, project, progress)
    if data is None:
        return code, None, code_dir, None
    stats, data_dir = push_data(host, data, progress)
    return code, stats, code_dir, data_dir
