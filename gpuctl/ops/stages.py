"""The stages of starting a run, named in one place (`Stage`), each a function here:

    push        code and data to every node, each to its own place, then linked into the run's dir (ops/push.py)
    preflight   each node's TensorFlow (ops/setup.py), looked at while the code is pushed
    packages    the project's requirements.txt in a venv over that TensorFlow (ops/packages.py)
    configure   the run's run.json on every node (queue, store, reports)
    start       its job under tmux on every node, at once; a node that fails stops them all
    arm guards  the watchdog on every node (ops/guards.py)
    place       the run's place in the chief's queue, read back

`train` (ops/runs.py) runs them all through `start_new`; a resume on a new machine or several
nodes (ops/recovery.py `resume_here`) runs push, configure and start; `resume` on the same host
arms the guards as train does; `plan` probes start their runs through `train`. What a node
answered on the way (its Python, its GPUs, its payload) is the command's Session's
(`Session.facts`), so each is asked once.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import time
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any

from gpuctl.config.load import PROJECT_FILE, LoadedSettings
from gpuctl.errors import NotFoundError, RemoteError
from gpuctl.model.records import ClusterRecord, InstanceRecord, RunRecord, Segment
from gpuctl.model.requests import TrainRequest
from gpuctl.model.results import TfEnv, TrainResult
from gpuctl.model.volumes import ENV_VAR as VOLUME_ENV
from gpuctl.ops import datasets, guards, nodes, packages, provenance, push, queue, setup
from gpuctl.ops.nodes import Node
from gpuctl.ops.session import Progress, Session, each, quiet, serialized
from gpuctl.payloads.gpuctl_protocol import RUN_CONFIG_FILE, RunConfig, StoreConfig
from gpuctl.remote import jobs, preflight
from gpuctl.remote.host import Host
from gpuctl.remote.sync import ignore
from gpuctl.retry import TimedOut, poll

LAUNCHER = "gpuctl_run.py"


class Stage(str, Enum):
    PUSH = "push"
    PREFLIGHT = "preflight"
    PACKAGES = "packages"
    CONFIGURE = "configure"
    START = "start"
    ARM_GUARDS = "arm guards"
    PLACE = "place"


def start_new(s: Session, req: TrainRequest, loaded: LoadedSettings, project: Path, entry: str,
              record: ClusterRecord, secret_env: dict[str, str], progress: Progress = quiet,
              fetch: datasets.Fetch | None = None) -> TrainResult:
    """`train` on the (locked) cluster: every stage, in order; the run started and placed.
    `fetch`: an S3 data set (checked from here already), which each node fetches itself."""
    settings = loaded.settings
    group = group_of(s, record)
    nodes.refuse_budget(group, settings.train.budget_usd)  # before the push
    chief_facts = s.facts(group[0].host)
    node_gpus = queue.gpus_of(group[0].host, lambda why: progress(f"note: {why}"), chief_facts)
    want = queue.asked(req.gpus, node_gpus, len(group))
    run_id = f"{push.slug(project.name)}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    paths = jobs.JobPaths(posixpath.join(group[0].host.root, "runs", run_id))
    # The project's own gpuctl.toml may pin its TensorFlow; otherwise the cluster's (`up --tf`)
    # holds: a user-wide setting or variable was already the cluster's default at `up`.
    asked = settings.train.tensorflow if loaded.sources.get("train.tensorflow") == str(project / PROJECT_FILE) else None
    wanted = packages.requirements_of(loaded, project)  # a bad train.requirements: before the push
    say_left_out(project, req.data, req.args, progress)
    group = push_and_check(s, record, group, project, req.data, progress, asked, check=not group[0].host.local,
                           recheck=req.recheck, allow_cpu=req.allow_cpu, run_id=run_id, fetch=fetch)
    refuse_cpu(group, req.allow_cpu)
    chief = group[0]
    check_keras(group, nodes.keras_for(settings.train.keras, len(group)), progress)
    group, installed = install_packages(s, record, group, wanted, progress)
    now = time.time()
    # The run is billed at every node's rate: its epochs cost seconds x their sum; on one node, at
    # its share (GPUs held / the node's), which the instance confirms when the run leaves the queue.
    rate = nodes.rate(group) * (want / queue.slots(node_gpus) if len(group) == 1 else 1.0)
    run = RunRecord(run_id=run_id, cluster=record.name, cluster_id=record.id, project=str(project), entry=entry,
                    args=req.args, state="starting", started_at=now, usd_per_hour=rate,
                    run_dir=paths.run_dir, tf_log_level=settings.train.tf_log_level,
                    budget_usd=settings.train.budget_usd, env_names=tuple(secret_env),
                    tensorflow=chief.env.tensorflow if chief.env else None, image=_image(chief.inst),
                    data=fetch.listing.source.url if fetch else str(req.data) if req.data else None,
                    **fetched_of(chief), code=provenance.of(project), segments=(segment_on([n.inst for n in group], now, rate),),
                    nodes=len(group), gpus=want, now=req.now,
                    start_timeout_s=settings.train.start_timeout_s if len(group) > 1 else 0.0, **installed)
    # train --down counts runs that end after this moment (the instance's clock): taken before the
    # job starts, so a script that fails at once still ends the spend after the grace.
    down_after = req.down_after_run if req.down_after_run is not None else settings.guards.down_after_run
    armed_at = guards.instance_now(chief.host) if down_after else None
    run = launch(s, loaded, record, run, group, secret_env, stop_after=req.stop_after)
    # The job starts while a new cluster's watchdog does (each takes ~0.1 s to answer), so its
    # place in the queue is there to read once the watchdog's first look is.
    arm_guards(s, loaded, record, progress, req.down_after_run, armed_at)
    run = place(s, chief.host, run)
    s.ledger.event("train", f"started {entry} in {project}" + (f" on {len(group)} nodes" if len(group) > 1 else ""),
                   cluster=record, run_id=run_id)
    assert chief.code is not None  # push_and_check pushed the code to every node
    return TrainResult(run=run, code_sync=chief.code, data_sync=chief.data, data_fetch=chief.fetched, session=run_id,
                       host=chief.host.label, node_gpus=node_gpus)


def fetched_of(chief: Node) -> dict[str, Any]:
    """The run record's fields of the chief's fetch of an S3 data set (none: no such data set)."""
    if chief.fetched is None:
        return {}
    return {"data_fetch_s": chief.fetched.seconds, "data_fetch_bytes": chief.fetched.fetched_bytes}


def group_of(s: Session, record: ClusterRecord) -> list[Node]:
    """The cluster's nodes for a run: all of them (a run needs every node the cluster was made with)."""
    group = nodes.of(s, record)
    missing = sorted(set(range(max(record.spec.nodes, len(group)))) - {n.rank for n in group})
    if missing:  # its machine ended (an interruption nobody followed, a guard): a run needs them all
        raise RemoteError(f"cluster {record.name!r} lacks node {missing[0]}: its machine has ended",
                          f"Release it and start again: `gpuctl down {record.name} -y`, then `gpuctl up`.")
    return group


# --- push, preflight ------------------------------------------------------------------------------

def push_and_check(s: Session, record: ClusterRecord, group: list[Node], project: Path, data: Path | None,
                   progress: Progress, asked: str | None = None, check: bool = False,
                   recheck: bool = False, allow_cpu: bool | None = None, run_id: str | None = None,
                   fetch: datasets.Fetch | None = None) -> list[Node]:
    """Push code (and data) to every node and find each one's TensorFlow (set up if need be);
    `check`: the preflight too (`recheck`: not the answer kept from an earlier one); with
    `allow_cpu` given and data to push, its verdict (refuse_cpu) before the push. `run_id`: the
    run's own copies made on each node right after its push (push.submit), where its job runs.
    `fetch`: an S3 data set each node fetches itself into its data store (what its disk must
    hold checked on every node first, before anything is set up or pushed)."""
    lacking: dict[int, list[int]] = {}
    stores: dict[int, str | None] = {}  # where each node keeps the data set (the chief: on a volume)
    if fetch is not None:
        checked = fetch
        stores = {n.rank: datasets.store_on(s, record, n.rank, n.host) for n in group}
        lacking = dict(zip([n.rank for n in group],
                           each(group, lambda n: datasets.prepare(s, n.host, checked, stores[n.rank]))))
        # Every disk holds it: the cluster's role (where it has one) may read it from now on.
        fetch = datasets.granted(s, record, fetch, progress)

    def pushed(node: Node) -> Node:
        say = lambda line: progress(nodes.label(node, group) + line)  # noqa: E731
        code, stats, code_dir, data_dir = push.push_all(node.host, project, data, say)
        fetched = datasets.fetch_on(s, node.host, fetch, lacking[node.rank], say, stores.get(node.rank)) \
            if fetch is not None else None
        if fetched is not None:
            data_dir = fetched.data_dir
        if run_id is not None:
            code_dir, data_dir = push.submit(node.host, posixpath.join(node.host.root, "runs", run_id),
                                             code_dir, data_dir, datasets.run_copies(stores.get(node.rank)))
        return replace(node, code_dir=code_dir, data_dir=data_dir, code=code, data=stats, fetched=fetched)

    # The TensorFlow first (a setup that fails has nothing pushed), then the code pushed while the
    # preflight looks: on a new environment that is seconds of TensorFlow import (or the wait for
    # the one `up` started), which the push no longer adds to.
    found = setup.ensure(s, record, progress, asked, check=False)
    if not check:
        return [replace(node, env=_env_of(found, node)) for node in each(group, pushed)]
    progress = serialized(progress)  # the pushes' lines and the preflight's come from two threads
    with setup.looking(s, record, found, progress, recheck) as looked:
        if (data is not None or fetch is not None) and allow_cpu is not None:
            # The data is the bulk (minutes of it): a node where the run cannot start (no GPU, no
            # usable TensorFlow) is refused before it, not after. The code alone still goes meanwhile.
            refuse_cpu([replace(node, env=_env_of(looked(), node)) for node in group], allow_cpu)
        group = each(group, pushed)
        envs = looked()
    return [replace(node, env=_env_of(envs, node)) for node in group]


def say_left_out(project: Path, data: Path | None, args: tuple[str, ...], progress: Progress) -> None:
    """Before the push: what the ignore rules leave out that the script's arguments name (in the
    project, not in --data) or that is at the top of the --data directory, each with its rule."""
    named = [rel for rel in ignore.named_by(project, args)
             if data is None or not (project / rel).resolve().is_relative_to(data)]
    for line in ignore.named_left_out(project, named):
        progress(f"code: {line}")
    if data is not None:
        with os.scandir(data) as entries:  # the top of it, bounded: a flat folder may hold 100,000 files
            top = sorted(e.name for _, e in zip(range(DATA_TOP), entries))
        for line in ignore.named_left_out(data, top, data=True):
            progress(f"data: {line}")


DATA_TOP = 1000  # entries at the top of a --data directory asked about before the push


def _env_of(envs: tuple[TfEnv, ...], node: Node) -> TfEnv:
    """The node's own (envs are by host label)."""
    return next(e for e in envs if e.host == node.host.label)


def refuse_cpu(group: list[Node], allow_cpu: bool) -> None:
    """What the preflight saw on each node, refused where it cannot train (no GPU, unless allowed)."""
    for node in group:
        report = node.env.report if node.env is not None else None
        refusal = preflight.verdict(report, allow_cpu) if report is not None else None
        if refusal:
            raise RemoteError(f"not starting on {node.host.label}: {refusal}",
                              "Pass --allow-cpu to train on the CPU anyway, or `gpuctl down` and `gpuctl up` "
                              "again with `remote.python` set to the Python that has TensorFlow with GPU support.")


def check_keras(group: list[Node], keras: str, progress: Progress = quiet) -> None:
    """tf_keras on every node where the run uses Keras 2 (a warning where Keras 3 will fail)."""
    if keras == "3" and len(group) > 1:
        progress(f"warning: train.keras = \"3\" on {len(group)} nodes: Keras 3's fit fails under "
                 "MultiWorkerMirroredStrategy (keras#20585); leave train.keras at \"auto\" (Keras 2 here) unless "
                 "the script trains without Keras fit")
    if keras == "2":
        chief = group[0].env
        nodes.require_keras2(group, chief.tensorflow if chief is not None else None)


def install_packages(s: Session, record: ClusterRecord, group: list[Node], found: tuple[str, bytes] | None,
                     progress: Progress = quiet) -> tuple[list[Node], dict[str, Any]]:
    """The project's requirements file (`packages.requirements_of`) on every node, in a venv over
    its TensorFlow (made once per file): the nodes, each with that venv's Python; the run's record
    of it (none without the file)."""
    if found is None:
        return group, {}
    name, data = found
    progress = serialized(progress)

    def one(node: Node) -> tuple[Node, float]:
        python, seconds = packages.ensure(s, node.host, node.python, name, data, record.spec.remote.wheelhouse,
                                          lambda line: progress(nodes.label(node, group) + line))
        return replace(node, layered=python), seconds

    done = each(group, one)
    return [n for n, _ in done], {"packages": packages.label(name, data),
                                  "packages_s": max(seconds for _, seconds in done)}


# --- configure, start -----------------------------------------------------------------------------

def launch(s: Session, loaded: LoadedSettings, record: ClusterRecord, run: RunRecord, group: list[Node],
           secret_env: dict[str, str], resumed: bool = False, stop_after: int | None = None) -> RunRecord:
    """Configure the run on every node and start its job there (node 0, the chief, reports and
    checkpoints for the run); the run, running. `resumed`: the run goes on from its checkpoint
    (restored from the store on a new instance); `stop_after`: it ends after that many epochs."""
    extra = nodes.job_env(group, nodes.keras_for(loaded.settings.train.keras, len(group)))
    _refuse_released(s, record)
    commands = configure(s, loaded, record, run, group, resumed, stop_after)
    s.ledger.put_run(run)
    return start(s, record, run, group, commands, extra, secret_env)


def configure(s: Session, loaded: LoadedSettings, record: ClusterRecord, run: RunRecord, group: list[Node],
              resumed: bool = False, stop_after: int | None = None) -> list[list[str]]:
    """Write the run's run.json on every node; each node's command for its job."""
    settings = loaded.settings
    store = s.provider(record.spec).checkpoint_store()
    target = store.target(record.spec.store_place) if store is not None else None

    def one(node: Node) -> list[str]:
        facts = s.facts(node.host)
        payload_dir = guards.push_payload(node.host, facts)
        chief, paths = node.rank == 0, node.paths(run)
        node_gpus = queue.gpus_of(node.host, facts=facts)
        config = RunConfig(
            run_id=run.run_id, entry=run.entry, usd_per_hour=run.usd_per_hour,
            budget_usd=run.budget_usd, mixed_precision=settings.train.mixed_precision,
            memory_growth=settings.train.memory_growth,
            # nvidia-smi every so often while it trains: each epoch's GPU utilisation and memory.
            gpu_sample_s=settings.train.gpu_sample_s,
            # The launcher (the reporter) ends the run after this many epochs: a plan's probe.
            stop_after_epochs=stop_after,
            # The chief's reports are the run's; another node's stay in its own run dir, unread.
            report_path=paths.epochs,
            # Each Keras fit checkpoints after every epoch here (train --resume starts from it).
            checkpoint_dir=nodes.checkpoint_dir(paths) if settings.train.checkpoint == "auto" else None,
            # Where the watchdog records a spot interruption notice (the job then stops as preempted).
            notice_file=nodes.notice_file(node.host),
            # The run's files also go to the store after each epoch, where the store outlives the instance.
            store=StoreConfig(target=target.model_dump(), key_prefix=target.run_prefix(run.run_id),
                              # The instance's credentials (its role) come from this metadata service.
                              imds_endpoint=record.spec.metadata_endpoint,
                              # Only the chief's checkpoint counts; the others restore from it, never write it.
                              read_only=not chief) if target else None,
            resumed=resumed,
            # Where its job runs and reads: the run's own copies of what was pushed (push.submit).
            code_dir=node.code_dir or None, data_dir=node.data_dir,
            code_hash=run.code.hash if run.code else None,
            # The job waits its turn in the node's queue first (a multi-node run takes whole nodes).
            queue=queue.config(node.host, min(run.gpus, queue.slots(node_gpus)) if run.gpus and len(group) == 1
                               else queue.slots(node_gpus), node_gpus,
                               node.inst.usd_per_hour if len(group) == 1 else run.usd_per_hour, run.now),
        )
        config_path = posixpath.join(paths.run_dir, RUN_CONFIG_FILE)
        node.host.write_text(config_path, config.to_json())
        return [node.python, posixpath.join(payload_dir, queue.PAYLOAD), config_path,
                posixpath.join(payload_dir, LAUNCHER), *run.args]

    return each(group, one)


def start(s: Session, record: ClusterRecord, run: RunRecord, group: list[Node], commands: list[list[str]],
          extra: list[dict[str, str]], secret_env: dict[str, str]) -> RunRecord:
    """Start the run's job on every node at once (threads, as many as nodes up to 16); the run,
    running. A node whose start fails (its error is the one raised, the first in rank order)
    stops the run on every node and records it failed: a run on some nodes only would wait for
    the others forever."""
    def one(node: Node, command: list[str], more: dict[str, str]) -> None:
        paths = node.paths(run)
        env = {"GPUCTL_RUN_ID": run.run_id, "GPUCTL_RUN_DIR": paths.run_dir, "GPUCTL_OUTPUT_DIR": paths.outputs,
               # TensorFlow's C++ start-up chatter (oneDNN, cuInit, absl) is not the user's output.
               "TF_CPP_MIN_LOG_LEVEL": str(run.tf_log_level), **more}
        if node.data_dir:
            env["GPUCTL_DATA_DIR"] = node.data_dir
        if node.rank == 0 and record.spec.volume is not None:  # `up --volume`: the chief's, mounted there
            env[VOLUME_ENV] = s.provider(record.spec).mount_volume(node.host)[0]
        jobs.start_job(node.host, run.run_id, node.code_dir, command, env, paths, secret_env)

    try:
        _refuse_released(s, record)
        each(list(zip(group, commands, extra)), lambda job: one(*job))  # every start returned, or raised
        _refuse_released(s, record)  # a `down` went ahead while this command was held up (Ctrl-Z)
    except BaseException:
        # Every node is stopped, not only those whose start returned: one may have started
        # before its connection dropped, or while another node's start failed.
        try:
            nodes.stop(group, run, must=False)  # a node whose tmux fails: the start's own error says more
        finally:
            s.ledger.put_run(run.model_copy(update={"state": "failed", "ended_at": time.time()}))
        raise
    run = run.model_copy(update={"state": "running"})
    s.ledger.put_run(run)
    return run


def _refuse_released(s: Session, record: ClusterRecord) -> None:
    """A `down` does not wait long for this command's lock (a `train` stopped with Ctrl-Z would
    hold the brake): a command that resumes after it began must start nothing there."""
    if s.released(record):
        raise NotFoundError(f"cluster {record.name!r} was released by `gpuctl down` while this command was under "
                            "way; nothing of this run runs there", "Start one with `gpuctl up`, then train again.")


# --- arm guards, place ----------------------------------------------------------------------------

def arm_guards(s: Session, loaded: LoadedSettings, record: ClusterRecord, progress: Progress,
               down_after_run: bool | None = None, armed_at: float | None = None) -> None:
    """The watchdog on every node, with the limits of this command's settings."""
    progress(f"watchdog: {guards.install(s, loaded, record, down_after_run, armed_at)}")


def place(s: Session, host: Host, run: RunRecord, within_s: float = 10.0) -> RunRecord:
    """The run as the instance's queue placed it (queued with its position, or running), once the
    queue has answered (the job writes its place first thing, tens of ms after its start); as it
    was after `within_s`."""
    try:
        where = poll(lambda: queue.look(host, run.run_dir), within_s, first_delay_s=0.02, max_delay_s=0.2)
    except TimedOut:
        return run
    if where["state"] == "queued":
        run = run.model_copy(update={"state": "queued", "queue_position": where.get("position")})
        s.ledger.put_run(run)
    return run


def segment_on(group: list[InstanceRecord], at: float, usd_per_hour: float | None = None) -> Segment:
    """A run's stretch on these instances, chief first (`usd_per_hour`: all of theirs), from `at`."""
    inst = group[0]
    return Segment(instance_id=inst.id, node_ids=tuple(i.id for i in group[1:]), zone=inst.zone, market=inst.market,
                   usd_per_hour=inst.usd_per_hour if usd_per_hour is None else usd_per_hour, started_at=at)


def _image(inst: InstanceRecord) -> str | None:
    if not inst.image_id:
        return None
    return f"{inst.image_name} ({inst.image_id})" if inst.image_name else inst.image_id
