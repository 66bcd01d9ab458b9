"""`gpuctl train --resume RUN`: a failed, stopped or lost run starts again where its checkpoint
left it, on its cluster, as the same run (same id, arguments, log and epoch numbering).

The launcher checkpoints every Keras `fit` after each epoch (BackupAndRestore, see
payloads/gpuctl_run.py), so a run killed mid-epoch loses at most that epoch. Resuming re-runs the
run's own job script (its command and environment as `train` wrote them), after pushing the
project's code again (a fix made since counts), with `train --env` values asked afresh.
Checkpoints live in the run's outputs on the host; on aws they are also in the cluster's store
(S3), so a run whose instance is gone resumes on a new one (ops/recovery.py).
"""

from __future__ import annotations

import json
import posixpath
import time
from pathlib import Path

from gpuctl.errors import ConflictError, GpuctlError, NotFoundError, RemoteError
from gpuctl.ops import guards, run_state, runs
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.remote import jobs
from gpuctl.types import RunRecord

RESUMABLE = ("failed", "stopped", "lost", "preempted")


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
    if _in_store(s, run) and (cluster is None or not _host_answers(s, cluster)):
        # Its instance is gone (a spot interruption), its checkpoint is not: a new instance, the same run.
        from gpuctl.ops import recovery

        recovery.replace(s, s.ledger.cluster(run.cluster_id), progress, s.settings().settings.recover.fallback_on_demand)
        return recovery.resume_on_new(s, run, progress)
    if cluster is None:
        spec = s.ledger.cluster(run.cluster_id).spec
        keep = (" (keep the next run's checkpoints off the instance: aws.checkpoints = \"s3\")"
                if spec.checkpoints == "instance" else "")
        raise NotFoundError(f"cannot resume run {run.run_id}: its cluster {run.cluster!r} is gone, and its "
                            "checkpoint with it", f"Start it anew: gpuctl train {run.project}{keep}")
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
            inst = s.host(record)[0]
            run = run.model_copy(update={"state": "running", "exit_code": None, "ended_at": None, "resumed_at": now,
                                         "resumes": run.resumes + 1,
                                         "segments": run.segments + (runs.segment_on(inst, now),)})
            jobs.restart_job(host, run.run_id, paths, secret_env)
            s.ledger.put_run(run)
            progress(f"watchdog: {guards.install(s, s.settings(), record)}")
    s.ledger.event("resume", f"resumed from {ckpt}", cluster=record, run_id=run.run_id)
    return run


def _in_store(s: Session, run: RunRecord) -> bool:
    """Whether the run's checkpoint is in its cluster's store (one that outlives instances)."""
    store = s.provider(s.ledger.cluster(run.cluster_id).spec).checkpoint_store()
    if store is None:
        return False
    files = store.files(run.cluster, run.run_id)
    return any(path.startswith("outputs/checkpoint/") for path, _ in files)


def _host_answers(s: Session, cluster) -> bool:
    try:
        s.host(cluster)
        return True
    except GpuctlError:
        return False


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
