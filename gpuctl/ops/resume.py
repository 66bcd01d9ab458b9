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
import tempfile
import time
from pathlib import Path

from gpuctl.errors import ConflictError, GpuctlError, NotFoundError, RemoteError
from gpuctl.model import untrusted
from gpuctl.model.records import ENDED_STATES, RESUMABLE, ClusterRecord, RunRecord
from gpuctl.ops import nodes, provenance, push, recovery, run_state, runs, stages
from gpuctl.ops.session import Progress, Session, each, quiet
from gpuctl.remote import jobs
from gpuctl.remote.host import Host



def resume(s: Session, run_id: str, progress: Progress = quiet, on: str | None = None) -> RunRecord:
    """Start the run again from its last checkpoint (on cluster `on`, else its own); the run as
    now recorded."""
    run = run_state.settle_or_keep(s, s.find_run(run_id))
    if run.state not in RESUMABLE:
        what = {"succeeded": "it succeeded: there is nothing to resume"}.get(run.state, f"it is {run.state}")
        raise ConflictError(f"cannot resume run {run.run_id}: {what}",
                            "Resume a failed, stopped, lost or preempted run; `gpuctl status` lists them.")
    if on is not None:
        target = s.resolve_cluster(on)
        if target.id != run.cluster_id:
            return _resume_elsewhere(s, run, target, progress)
    cluster = s.live_cluster_of(run)
    if in_store(s, run) and (cluster is None or run.state == "preempted" or _instance_ended(s, run)):
        # Its instance is gone (a spot interruption), its checkpoint is not: a new instance, the same run.

        ready = recovery.ready_to_resume(s, run)  # before anything is launched
        with s.cluster_lock(s.ledger.cluster(run.cluster_id), progress) as record:
            recovery.replace(s, record, progress, s.settings().settings.recover.fallback_on_demand,
                             recovery.machines_taken(run))
        return recovery.resume_on_new(s, run, progress, ready=ready)
    kept = s.kept_run(run) if cluster is None else None
    if kept is not None and has_checkpoint(kept[0], jobs.JobPaths(kept[1])):
        raise NotFoundError(f"cannot resume run {run.run_id} here: its cluster {run.cluster!r} is gone (its "
                            "checkpoint was kept)", f"Resume it on a live cluster: gpuctl train --resume "
                            f"{run.run_id} --cluster OTHER")
    if cluster is None:
        spec = s.ledger.cluster(run.cluster_id).spec
        raise NotFoundError(f"cannot resume run {run.run_id}: its cluster {run.cluster!r} is gone, and its "
                            "checkpoint with it", f"Start it anew: gpuctl train {run.project}{spec.checkpoint_hint}")
    if run.nodes > 1:
        return _resume_nodes(s, run, cluster, progress)
    secret_env = runs.env_values(s, run.env_names)  # asked before anything moves
    with s.cluster_lock(cluster, progress) as record:
        _still_up(record, run)
        _, host = s.host(record)
        paths = jobs.JobPaths(run.run_dir)
        ckpt = _require_checkpoint(host, run, paths)
        with s.working(record, "train"):
            project = Path(run.project)
            if project.is_dir():  # a new submission: the code as it is now, linked over the run's own
                push.submit(host, run.run_dir, push.push_code(host, project, progress)[1], None)
                run = run.model_copy(update={"code": provenance.of(project)})
            else:
                progress(f"{project} is not here: resuming with the code already on {host.label}")
            _mark_resumed(host, paths)
            now = time.time()
            inst = s.host(record)[0]
            run = run.model_copy(update={"state": "running", "exit_code": None, "ended_at": None, "resumed_at": now,
                                         "resumes": run.resumes + 1,
                                         "segments": run.segments + (stages.segment_on([inst], now),)})
            jobs.restart_job(host, run.run_id, paths, secret_env)
            s.ledger.put_run(run)
            stages.arm_guards(s, s.settings(), record, progress)
    s.ledger.event("resume", f"resumed from {ckpt}", cluster=record, run_id=run.run_id)
    return run


def _still_up(record: ClusterRecord, run: RunRecord) -> None:
    """The cluster, now locked, was not released by a `down` while this command waited for it."""
    if record.state != "up":
        raise NotFoundError(f"cluster {record.name!r} was released while this command waited for it",
                            f"Start run {run.run_id} anew with gpuctl train.")


def _resume_nodes(s: Session, run: RunRecord, cluster: ClusterRecord, progress: Progress) -> RunRecord:
    """A multi-node run on its own cluster: the chief's checkpoint copied to every node, then the
    run started anew on all of them as resumed (fresh ports: the old ones may be taken by now)."""
    ready = recovery.ready_to_resume(s, run)  # project, data and --env values: before anything moves
    with s.cluster_lock(cluster, progress) as record:
        _still_up(record, run)
        group = nodes.of_run(s, record, run)
        ckpt = _require_checkpoint(group[0].host, run, jobs.JobPaths(run.run_dir))
        with s.working(record, "train"):
            # Every worker restores from the chief's checkpoint (Keras reads CHECKPOINT/chief on each).
            nodes.share_checkpoint(group, run, progress)
            each(group, lambda n: jobs.clear_ends(n.host, run.run_id, n.paths(run)))
            run = recovery.resume_here(s, record, run, ready, progress)
    s.ledger.event("resume", f"resumed from {ckpt} on {len(group)} nodes", cluster=record, run_id=run.run_id)
    return run


def _resume_elsewhere(s: Session, run: RunRecord, target: ClusterRecord, progress: Progress) -> RunRecord:
    """The run's checkpoint and reports go to another (live) cluster, and the run goes on there:
    copied inside the store when both clusters share one, else from its old host through here."""
    group = nodes.of(s, target)
    have, want = len(group), max(run.nodes, 1)
    if have != want:
        # Its checkpoint is one of a Keras (2 on several nodes, 3 on one) the other count would not
        # read: the run would start over, billed, as if resumed.
        raise ConflictError(f"run {run.run_id} ran on {want} node(s); cluster {target.name!r} has {have}",
                            f"Resume it on a cluster of {want} node(s) (`gpuctl up --nodes {want}`), or start it "
                            f"anew: gpuctl train {run.project} --cluster {target.name}")
    source = s.ledger.cluster(run.cluster_id)
    theirs, ours = s.provider(source.spec).checkpoint_store(), s.provider(target.spec).checkpoint_store()
    if theirs is not None and ours is not None and in_store(s, run) and \
            theirs.target(source.spec.store_place).bucket == ours.target(target.spec.store_place).bucket:
        progress(f"copied {ours.copy(source.spec.store_place, target.spec.store_place, run.run_id)} files of the run to "
                 f"{target.name}'s place in the store")
        return recovery.resume_on_new(s, run, progress, cluster=target)
    live = s.live_cluster_of(run)
    kept = s.kept_run(run) if live is None else None
    if kept is not None:
        old, paths = kept[0], jobs.JobPaths(kept[1])  # kept by the provider when its cluster went
    elif live is None or not _host_answers(s, live):
        raise NotFoundError(f"cannot resume run {run.run_id} on {target.name!r}: its checkpoint was on cluster "
                            f"{run.cluster!r}, which is gone or does not answer", f"Start it anew: gpuctl train "
                            f"{run.project} --cluster {target.name}")
    else:
        _, old = s.host(live)
        paths = jobs.JobPaths(run.run_dir)
    _require_checkpoint(old, run, paths)
    moved = run.model_copy(update={"run_dir": posixpath.join(group[0].host.root, "runs", run.run_id)})
    with tempfile.TemporaryDirectory(prefix="gpuctl-resume-") as tmp:
        old.pull_tree(paths.outputs, Path(tmp) / "outputs")
        # Every node of the target restores the same checkpoint (Keras reads CHECKPOINT/chief on each).
        each(group, lambda n: n.host.push(Path(tmp) / "outputs", n.paths(moved).outputs, progress=lambda line:
                                                progress(f"{nodes.label(n, group)}checkpoint: {line}")))
    new = group[0].host
    new.write_text(jobs.JobPaths(moved.run_dir).epochs, (old.read_bytes(paths.epochs) or b"").decode("utf-8", "replace"))
    progress(f"brought the run's checkpoint and reports from {old.label} to {new.label}")
    return recovery.resume_on_new(s, moved, progress, cluster=target)


def has_checkpoint(host: Host, paths: jobs.JobPaths) -> bool:
    ckpt = nodes.checkpoint_dir(paths)
    return bool(host.run(["find", ckpt, "-type", "f", "-print", "-quit"], check=False).stdout.strip())


def _require_checkpoint(host: Host, run: RunRecord, paths: jobs.JobPaths) -> str:
    """The run's checkpoint directory on the host; NotFoundError when it holds no file."""
    ckpt = nodes.checkpoint_dir(paths)
    if not has_checkpoint(host, paths):
        raise NotFoundError(f"run {run.run_id} has no checkpoint on {host.label} ({ckpt} is empty or missing)",
                            "Only Keras fits checkpoint (train.checkpoint = \"auto\"); start it anew with "
                            f"gpuctl train {run.project}.")
    return ckpt


def in_store(s: Session, run: RunRecord) -> bool:
    """Whether the run's checkpoint is in its cluster's store (one that outlives instances)."""
    spec = s.ledger.cluster(run.cluster_id).spec
    store = s.provider(spec).checkpoint_store()
    if store is None:
        return False
    files = store.files(spec.store_place, run.run_id)
    return any(path.startswith("outputs/checkpoint/") for path, _ in files)


def _instance_ended(s: Session, run: RunRecord) -> bool:
    """Whether the provider says the run's instance ended (not merely that SSH failed once); on
    several nodes, any node's: the run needs them all."""
    fresh = recovery.instances_now(s, run)
    ended = [i.state in ENDED_STATES for i in fresh]
    return bool(fresh) and (any(ended) if run.nodes > 1 else all(ended))


def _host_answers(s: Session, cluster: ClusterRecord) -> bool:
    try:
        s.host(cluster)
        return True
    except GpuctlError:
        return False


def _mark_resumed(host: Host, paths: jobs.JobPaths) -> None:
    """run.json says so: the launcher numbers the epochs from the checkpoint, not from 1."""
    config_path = posixpath.join(paths.run_dir, "run.json")
    try:
        config = untrusted.loads(host.read_bytes(config_path, 0, untrusted.MAX_JSON + 1))
    except untrusted.Untrusted:
        config = None
    if not isinstance(config, dict):
        raise RemoteError(f"the run's config {config_path} on {host.label} is missing or broken",
                          "Start the run anew with gpuctl train.")
    config["resumed"] = True
    host.write_text(config_path, json.dumps(config, indent=2))
