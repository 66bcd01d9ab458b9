"""Managed recovery: a run whose spot instance is taken away goes on, on a replacement.

A run is preempted when the watchdog heard the interruption notice (the job stopped at a batch end
with exit code 75, its last whole epoch checkpointed and in the store), or when its provider says
it took the instance away (EC2's state reason Server.SpotInstanceTermination, or the instance is
gone). Wherever gpuctl follows the run (`train --wait`, `logs -f`, `gpuctl watch`), recovery then
ends what is left of the old instance, launches one with the cluster's spec (the provider tries
every zone; on-demand too with recover.fallback_on_demand), pushes the code and data again and
starts the same run from its checkpoint (the launcher restores it from the store). With nothing
watching, a preempted run waits: the guards end all spend, and `status` offers `train --resume`.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Generator, Iterator

from gpuctl.errors import ConflictError, GpuctlError, ProjectError, RecoveryError
from gpuctl.model.data import S3Source, is_s3, parse_s3
from gpuctl.model.records import ENDED_STATES, FINAL_RUN_STATES, ClusterRecord, InstanceRecord, RunRecord
from gpuctl.ops import datasets, nodes, packages, provenance, release, run_state, runs, stages
from gpuctl.ops.session import Progress, Session, quiet

CHECK_INSTANCES_S = 15.0  # how often a follower asks the provider whether the run's instance still exists
MAX_RECOVERIES = 10  # interruptions of one run that gpuctl answers with a replacement
RETRY_S = 20.0  # the wait before the next try grows by this much per failed one


class Interrupted(Exception):
    """The run's instance was taken away while it was being followed."""


def enabled(s: Session, cluster: ClusterRecord, asked: bool | None = None) -> bool:
    """Whether to recover this cluster's runs: the flag, else recover.enabled ("auto": spot
    clusters); never where the provider takes no machine away (nothing to replace there)."""
    if s.provider(cluster.spec).interruption_notice() is None:
        return False
    if asked is not None:
        return asked
    setting = s.settings().settings.recover.enabled
    return setting == "on" or (setting == "auto" and cluster.spec.interruptible)


def instances_now(s: Session, run: RunRecord) -> list[InstanceRecord]:
    """The instances the run is on (every node's), as its provider says now (recorded in the
    ledger); [] when the provider cannot be asked (not a reason to launch or end anything)."""
    cluster = s.ledger.cluster(run.cluster_id)
    mine = nodes.run_instances(s, cluster.id, run)  # a worker's machine taken ends the run as the chief's
    try:
        fresh = s.provider(cluster.spec).reconcile(mine) if mine else []
    except GpuctlError:
        return []
    for inst in fresh:
        s.ledger.put_instance(cluster.id, inst)
    return fresh


def taken_away(s: Session, run: RunRecord) -> InstanceRecord | None:
    """The run's instance, if its provider took it away."""
    provider = s.provider(s.ledger.cluster(run.cluster_id).spec)
    return next((i for i in instances_now(s, run) if provider.was_interrupted(i)), None)


def mark_preempted(s: Session, run: RunRecord, inst: InstanceRecord) -> RunRecord:
    """A running run whose instance the provider took: preempted when the instance ended."""
    if run.state in FINAL_RUN_STATES and run.state != "lost":
        return run
    segments = run.segments
    if run.state == "lost" and segments and segments[-1].end == "lost":
        segments = segments[:-1] + (segments[-1].model_copy(update={"ended_at": None, "end": None}),)
    ended = run_state.ending(run.model_copy(update={"segments": segments}), "preempted",
                             inst.terminated_at or time.time(), run.exit_code)
    if run.nodes > 1:
        ended = ended.model_copy(update={"failed_node": inst.node})
    s.ledger.put_run(ended)
    s.ledger.event("run-preempted", inst.state_reason or "instance taken away", run_id=run.run_id,
                   cluster=s.ledger.cluster(run.cluster_id))
    return ended


def follow(s: Session, run_id: str, progress: Progress = quiet, recover: bool | None = None,
           poll_s: float = 0.5, raw: bool = False) -> Iterator[str]:
    """The run's log as it comes, across replacements: yields log text until the run has ended
    (recovered as many times as recover.max_attempts allows per interruption)."""
    run = s.find_run(run_id)
    while True:
        run = yield from _follow_one(s, run, poll_s, raw)
        if run.state != "preempted":
            return
        cluster = s.ledger.cluster(run.cluster_id)
        if not enabled(s, cluster, recover):
            progress(f"run {run.run_id} was preempted; recovery is off: `gpuctl train --resume {run.run_id}` "
                     "continues it")
            return
        if sum(1 for g in run.segments if g.end == "preempted") > MAX_RECOVERIES:
            raise RecoveryError(f"run {run.run_id} was preempted {MAX_RECOVERIES + 1} times: gpuctl recovers it no more",
                                f"Resume it on-demand: gpuctl train --resume {run.run_id} --cluster ON_DEMAND_CLUSTER")
        run = replace_and_resume(s, run, progress)


def watch(s: Session, run_id: str | None, progress: Progress = quiet) -> RunRecord:
    """`gpuctl watch`: follow the run (its log unshown) and recover it until it has ended, each
    decision time-stamped; the final run. A preempted run is recovered at once."""
    def say(line: str) -> None:
        progress(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")

    run = s.find_run(run_id)
    say(f"watching run {run.run_id} ({run.state}) on cluster {run.cluster}")
    for _ in follow(s, run.run_id, say, poll_s=2.0):
        pass
    run = s.find_run(run.run_id)
    say(f"run {run.run_id} {run.state}")
    return run


def detach(s: Session, run_id: str | None) -> tuple[RunRecord, int, Path]:
    """`gpuctl watch --detach`: the same, in a process of its own session that outlives the
    terminal; (the run, its pid, its log)."""
    import os
    import subprocess
    import sys

    run = s.find_run(run_id)
    logs = s.home / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = logs / f"watch-{run.run_id}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "watch", run.run_id], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    s.ledger.event("watch", f"supervisor pid {proc.pid}, log {log}", run_id=run.run_id)
    return run, proc.pid, log


def _follow_one(s: Session, run: RunRecord, poll_s: float, raw: bool) -> Generator[str, None, RunRecord]:
    """Follow the run on its current instance until it ends or the instance is taken away."""
    last_check = [s.clock.monotonic()]

    def check(current: RunRecord) -> None:
        if s.clock.monotonic() - last_check[0] >= CHECK_INSTANCES_S:
            last_check[0] = s.clock.monotonic()
            if taken_away(s, current) is not None:
                raise Interrupted()

    try:
        yield from run_state.logs(s, run.run_id, follow=True, poll_s=poll_s, raw=raw, check=check)
    except (Interrupted, GpuctlError) as exc:
        inst = taken_away(s, run)
        if inst is not None:
            return mark_preempted(s, s.find_run(run.run_id), inst)
        if isinstance(exc, GpuctlError):
            return _node_gone(s, run, exc)
        return s.find_run(run.run_id)
    ended = s.find_run(run.run_id)
    if ended.state == "lost" and ended.nodes > 1:
        # One node's machine gone, found by a look at the ledger: the provider says whether it
        # took it (a look before the provider had said so found only "lost").
        inst = taken_away(s, ended)
        return mark_preempted(s, ended, inst) if inst is not None else ended
    return ended


def _node_gone(s: Session, run: RunRecord, exc: GpuctlError) -> RunRecord:
    """After SSH failed: a node of several whose machine ended otherwise (a guard, the console)
    ends the run (a look without it finds it so, and stops its peers); else the error stands."""
    cluster = s.ledger.cluster(run.cluster_id)
    if run.nodes < 2 or nodes.gone(s, cluster, run) is None:
        raise exc
    s.forget_hosts(cluster)  # the connection that failed, and the host it was to
    return run_state.settle(s, s.find_run(run.run_id))


def replace_and_resume(s: Session, run: RunRecord, progress: Progress = quiet) -> RunRecord:
    """Launch a replacement for the preempted run's cluster and resume the run there, trying up to
    recover.max_attempts times; RecoveryError names every try. Under the cluster's lock: a second
    follower of the run (a `watch` beside a `train --wait`) finds it recovered and follows it."""
    settings = s.settings().settings.recover
    ready = ready_to_resume(s, run)  # before anything is launched
    tries: list[str] = []
    for attempt in range(1, settings.max_attempts + 1):
        with s.cluster_lock(s.ledger.cluster(run.cluster_id), progress) as cluster:
            current = s.find_run(run.run_id)
            if current.state != "preempted" or current.segments != run.segments:
                progress(f"run {run.run_id} was recovered by another gpuctl: following it")
                return current
            if cluster.state != "up" and any(e[3] == "down" for e in s.ledger.events(cluster.id)):
                raise ConflictError(f"cluster {cluster.name!r} was released with `gpuctl down`: not recovering run "
                                    f"{run.run_id}", f"Resume it when you want it: gpuctl train --resume {run.run_id}")
            progress(f"run {run.run_id} preempted: launching a replacement (try {attempt} of {settings.max_attempts})")
            try:
                replace(s, cluster, progress, settings.fallback_on_demand, machines_taken(current))
                return resume_here(s, s.ledger.cluster(cluster.id), run, ready, progress)
            except (ProjectError, ConflictError):
                raise  # no replacement can fix these
            except GpuctlError as exc:
                tries.append(f"try {attempt}: {exc.message}")
                s.ledger.event("recover-failed", exc.message, cluster=cluster, run_id=run.run_id)
                progress(f"try {attempt} failed: {exc.message}")
        if attempt < settings.max_attempts:
            s.clock.sleep(RETRY_S * attempt)  # capacity comes back in minutes, not seconds
    raise RecoveryError(f"run {run.run_id} was preempted and recovery gave up after {len(tries)} tries: "
                        + "; ".join(tries), f"Resume it when capacity returns: gpuctl train --resume {run.run_id}")


def machines_taken(run: RunRecord) -> set[str] | None:
    """The machines of a multi-node run that the provider is taking: those whose node stopped on
    a notice (or was found taken); None on one node (its machine is)."""
    if run.nodes < 2 or not run.segments:
        return None
    ids = run.segments[-1].instance_ids
    if len(ids) < run.nodes:  # recorded before segments named every node: wait as for one node
        return None
    ranks = {r for r, state in enumerate(run.node_states) if state in ("preempted", "leaving")} | {run.failed_node}
    return {ids[r] for r in ranks if r is not None and r < len(ids)}


def replace(s: Session, cluster: ClusterRecord, progress: Progress, fallback_on_demand: bool,
            taken: set[str] | None = None) -> list[InstanceRecord]:
    """End what is left of the cluster's instances (one the provider is taking, in `taken`, has
    two minutes at most), then launch new ones with its spec; the cluster is up again with them,
    guarded."""
    known = s.ledger.instances(cluster.id)
    # A launch token of its own per generation: EC2 keeps a RunInstances client token for a day
    # and would answer a replacement with the instance it replaces.
    spec = cluster.spec.model_copy(update={"launch_token": f"{cluster.spec.launch_token}-r{len(known)}"})
    if fallback_on_demand:
        spec = spec.on_demand_fallback()
    provider = s.provider(spec)
    left = [i for i in known if i.state not in ENDED_STATES]
    if left:
        for inst in provider.end_interrupted(left, progress, taken):
            s.ledger.put_instance(cluster.id, inst)
    if cluster.state != "up":
        try:
            s.ledger.reopen_cluster(cluster.id)
            s.settle_release(cluster)  # `train --resume` after a `down`: the cluster is up again
        except sqlite3.IntegrityError:
            raise ConflictError(f"cannot recover on cluster {cluster.name!r}: another cluster of that name is up",
                                f"Resume the run there yourself: gpuctl train --resume RUN --cluster {cluster.name}"
                                ) from None
    # Each replacement in the ledger as soon as it exists: a recovery that fails after (its SSH
    # wait) leaves nothing billing that `status` and `down` do not see.
    instances = provider.launch(progress, wait_ssh=True, launched=lambda i: s.ledger.put_instance(cluster.id, i))
    for inst in instances:
        s.ledger.put_instance(cluster.id, inst)
    if s.released(cluster):
        # A `down` went ahead while this recovery held the cluster (the brake waits 5 s at most, a
        # launch takes minutes): what was just launched goes too, and nothing is resumed there.
        gone = s.ledger.cluster(cluster.id)
        release.release_everything(s, gone, progress)
        release.close_in_ledger(s, gone, "a replacement launched while `down` went ahead, ended again")
        raise ConflictError(f"cluster {cluster.name!r} was released with `gpuctl down` while a replacement was "
                            f"launched; the replacement was ended again",
                            "Resume the run when you want it: gpuctl train --resume RUN")
    cluster = s.ledger.cluster(cluster.id)
    s.forget_hosts(cluster)
    s.ledger.event("recover", f"{len(instances)} replacement instance(s): {', '.join(i.id for i in instances)}",
                   cluster=cluster)
    stages.arm_guards(s, s.settings(), cluster, progress)
    return instances


Ready = tuple[Path, "Path | S3Source | None", dict[str, str]]  # the project, its data, the --env values


def ready_to_resume(s: Session, run: RunRecord) -> Ready:
    """What a resume that starts the run anew (a new instance, several nodes) needs from here,
    checked before anything is launched: the project, its data, the `--env` values."""
    project = Path(run.project)
    if not project.is_dir():
        raise ProjectError(f"cannot resume run {run.run_id}: its project {project} is not here",
                           "Run gpuctl from the machine (and checkout) that started it.")
    if run.data and is_s3(run.data):  # listed again, and new links made, where it resumes
        return project, parse_s3(run.data), runs.env_values(s, run.env_names)
    data = Path(run.data) if run.data else None
    if data is not None and not data.is_dir():
        raise ProjectError(f"cannot resume run {run.run_id}: its data {data} is not here",
                           "Run gpuctl from the machine that started it, with its --data directory in place.")
    return project, data, runs.env_values(s, run.env_names)


def resume_on_new(s: Session, run: RunRecord, progress: Progress = quiet, cluster: ClusterRecord | None = None,
                  ready: Ready | None = None) -> RunRecord:
    """Start the run again, as the same run, on a cluster whose host does not hold its files (a
    replacement instance, another cluster): code and data pushed again, checkpoint and reports
    restored from the store by the launcher; a new segment."""
    ready = ready or ready_to_resume(s, run)
    with s.cluster_lock(cluster or s.ledger.cluster(run.cluster_id), progress) as record:
        return resume_here(s, record, run, ready, progress)


def resume_here(s: Session, record: ClusterRecord, run: RunRecord, ready: Ready, progress: Progress) -> RunRecord:
    """Start the run on this (locked) cluster's nodes as resumed: code and data pushed, each
    node checked, a new segment; the launcher restores what a node lacks from the store."""
    project, data, secret_env = ready
    loaded = s.settings(project_dir=project)
    with s.working(record, "train"):
        each = stages.group_of(s, record)
        nodes.refuse_budget(each, run.budget_usd)
        wanted = packages.requirements_of(loaded, project)
        fetch = datasets.check(s, data, s.provider(record.spec).data_region(), progress) \
            if isinstance(data, S3Source) else None
        each = stages.push_and_check(s, record, each, project, data if isinstance(data, Path) else None, progress,
                                     run_id=run.run_id, fetch=fetch)
        each, installed = stages.install_packages(s, record, each, wanted, progress)
        stages.check_keras(each, nodes.keras_for(loaded.settings.train.keras, len(each)))
        inst, host = each[0].inst, each[0].host
        rate = nodes.rate(each)
        now = time.time()
        run = run.model_copy(update={
            "state": "starting", "exit_code": None, "ended_at": None, "resumed_at": now, "resumes": run.resumes + 1,
            "cluster": record.name, "cluster_id": record.id, "usd_per_hour": rate, "nodes": len(each),
            "failed_node": None, "node_states": (), "not_started": (), "code": provenance.of(project),
            "packages": None, "packages_s": None, **installed, **stages.fetched_of(each[0]),
            "run_dir": run.run_dir if run.run_dir.startswith(host.root + "/runs/") else f"{host.root}/runs/{run.run_id}",
            "segments": run.segments + (stages.segment_on([n.inst for n in each], now, rate),)})
        run = stages.launch(s, loaded, record, run, each, secret_env, resumed=True)
    s.ledger.event("resume", f"resumed on {inst.id} ({inst.zone or host.label})", cluster=record, run_id=run.run_id)
    progress(f"run {run.run_id} resumed on {inst.id}{f' in {inst.zone}' if inst.zone else ''}")
    return run
