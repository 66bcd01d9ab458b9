"""A project and its data on the way to a host: the checks made before anything is pushed or
launched (a project directory with its entry point, a data directory), and the pushes themselves,
each to its own directory on the host (code/NAME, data/NAME) so a code push never touches data."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from gpuctl.config.load import LoadedSettings
from gpuctl.errors import ProjectError
from gpuctl.model.records import SyncStats
from gpuctl.ops.session import Progress, Session
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


def push_code(host: Host, project: Path, progress: Progress) -> tuple[SyncStats, str]:
    """Push the project's code to its dir on the host (one per project name); (stats, that dir)."""
    code_dir = posixpath.join(host.root, "code", slug(project.name))
    return host.push(project, code_dir, progress=lambda line: progress(f"code: {line}")), code_dir


def push_data(host: Host, data: Path, progress: Progress) -> tuple[SyncStats, str]:
    """Push a data directory to its dir on the host (one per directory name); (stats, that dir)."""
    data_dir = posixpath.join(host.root, "data", slug(data.name))
    return host.push(data, data_dir, progress=lambda line: progress(f"data: {line}")), data_dir


def push_all(host: Host, project: Path, data: Path | None, progress: Progress
             ) -> tuple[SyncStats, SyncStats | None, str, str | None]:
    """Push code and (separately, so a code push never touches it) data; their remote dirs."""
    code, code_dir = push_code(host, project, progress)
    if data is None:
        return code, None, code_dir, None
    stats, data_dir = push_data(host, data, progress)
    return code, stats, code_dir, data_dir
