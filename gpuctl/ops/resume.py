"""`gpuctl train --resume RUN`: a failed, stopped or lost run starts again where its checkpoint
left it, on its cluster, as the same run (same id, arguments, log and epoch numbering).

The launcher checkpoints every Keras `fit` after each epoch (BackupAndRestore, see
payloads/gpuctl_run.py), so a run killed mid-epoch loses at most that epoch. Resuming re-runs the
run's own job script (its command and environment as `train` wrote them), after pushing the
project's code again (a fix made since counts), with `train --env` values asked afresh.
Checkpoints live in the run's outputs on the host: they go with a released cluster.
"""

from __future__ import annotations

import json
import posixpath
import time
from pathlib import Path

from gpuctl.errors import ConflictError, NotFoundError, RemoteError
from gpuctl.ops import guards, run_state, runs
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.remote import jobs
from gpuctl.types import RunRecord

RESUMABLE = ("failed", "stopped", "lost")


def checkpoint_dir(paths: jobs.JobPaths) -> str:
    return posixpath.join(paths.outputs, "checkpoint")


def resume(s: Session, run_id: str, progress: Progress = quiet) -> RunRecord:
    """Start the run again from its last checkpoint; the run as now recorded."""
    run = run_state.refresh_or_keep(s, s.find_run(run_id))
    if run.state not in RESUMABLE:
        what = {"succeeded": "it succeeded: there is nothing to resume"}.get(run.state, f"it is {run.state}")
        raise ConflictError(f"cannot resume run {run.run_id}: {what}",
                            "Resume a failed, stopped or lost run; `gpuctl status` lists them.")
    cluster = s.live_cluster_of(run)
    if cluster is None:
        raise NotFoundError(f"cannot resume run {run.run_id}: its cluster {run.cluster!r} was released, and its "
                            "checkpoint with it", f"Start it anew: gpuctl train {run.project}")
    secret_env = runs.env_values(s, run.env_names)  # asked before anything moves
    with s.cluster_lock(cluster, progress) as record:
        if record.state != "up":
            raise NotFoundError(f"cluster {record.name!r} was released while this command waited for it",
                                f"Start run {run.run_id} anew with gpuctl train.")
        _, host = s.host(record)
        paths = jobs.JobPaths(run.run_dir)
        ckpt = checkpoint_dir(paths)
        found = host.run(["find", ckpt, "-type", "f", "-print", "-quit"], check=False)
        if not found.stdout.strip():
            raise NotFoundError(f"run {run.run_id} has no checkpoint on {host.label} ({ckpt} is empty or missing)",
                                "Only Keras fits checkpoint (train.checkpoint = \"auto\"); start it anew with "
                                f"gpuctl train {run.project}.")
        with s.working(record, "train"):
            project = Path(run.project)
            if project.is_dir():
                runs.push_code(host, project, progress)
            else:
                progress(f"{project} is not here: resuming with the code already on {host.label}")
            _mark_resumed(host, paths)
            now = time.time()
            run = run.model_copy(update={"state": "running", "exit_code": None, "ended_at": None, "resumed_at": now,
                                         "resumes": run.resumes + 1})
            jobs.restart_job(host, run.run_id, paths, secret_env)
            s.ledger.put_run(run)
            progress(f"watchdog: {guards.install(s, s.settings(), record)}")
    s.ledger.event("resume", f"resumed from {ckpt}", cluster=record, run_id=run.run_id)
    return run


def _mark_resumed(host, paths: jobs.JobPaths) -> None:
    """run.json says so: the launcher numbers the epochs from the checkpoint, not from 1."""
    config_path = posixpath.join(paths.run_dir, "run.json")
    try:
        config = json.loads(host.read_bytes(config_path) or b"")
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise RemoteError(f"the run's config {config_path} on {host.label} is missing or broken",
                          "Start the run anew with gpuctl train.")
    config["resumed"] = True
    host.write_text(config_path, json.dumps(config, indent=2))
