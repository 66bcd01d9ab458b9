"""Runs: push a project (`sync`), start it (`train`), bring its outputs back (`pull`), run a
command on every host (`exec`). Following a run lives in run_state.py."""

from __future__ import annotations

import posixpath
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuctl.config.load import PROJECT_FILE, LoadedSettings
from gpuctl.errors import ConfigError, NotFoundError, RemoteError
from gpuctl.model.records import ClusterRecord, InstanceRecord, RunRecord, Segment
from gpuctl.model.results import ExecResult, PullResult, SyncResult, TrainResult
from gpuctl.ops import guards, nodes, push, queue
from gpuctl.ops.run_state import log_tail, logs, refresh, wait  # noqa: F401  (the run use cases, in one place)
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Progress, Session, quiet
from gpuctl.payloads.gpuctl_protocol import RUN_CONFIG_FILE, RunConfig, StoreConfig
from gpuctl.remote import jobs, preflight
from gpuctl.remote.host import NO_DEADLINE, Host
from gpuctl.retry import TimedOut, poll

LAUNCHER = "gpuctl_run.py"


def sync(s: Session, project: Path, cluster: str | None = None, data: Path | None = None,
         progress: Progress = quiet) -> SyncResult:
    """Push the project (and data) to every node of the cluster without starting anything; the
    chief's figures."""
    project, data = push.project_dir(project), push.check_data(data)
    record = s.resolve_cluster(cluster)
    group = nodes.of(s, record)
    with s.working(record, "push"):
        pushed = nodes.each(group, lambda n: push.push_all(n.host, project, data,
                                                      lambda line: progress(nodes.label(n, group) + line)))
    code, data_stats, code_dir, data_dir = pushed[0]
    return SyncResult(code=code, data=data_stats, code_dir=code_dir, data_dir=data_dir)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_values(s: Session, names: tuple[str, ...]) -> dict[str, str]:
    """`train --env NAME`: the values of these variables here, checked before anything happens."""
    out = {}
    for name in names:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"--env {name!r} is not an environment variable name",
                              "Give the name only, e.g. `--env HF_TOKEN` (the value is read from your environment).")
        if name.startswith("GPUCTL_") or name == "TF_CPP_MIN_LOG_LEVEL":
            raise ConfigError(f"--env {name}: gpuctl sets that one itself", "Pass another variable.")
        if name not in s.env:
            raise ConfigError(f"--env {name}: not set here", f"Set it first (`export {name}=...`), then train again.")
        out[name] = s.env[name]
    return out


def train(s: Session, project: Path, cluster: str | None = None, args: tuple[str, ...] = (), data: Path | None = None,
          allow_cpu: bool = False, progress: Progress = quiet, down_after_run: bool | None = None,
          env_names: tuple[str, ...] = (), gpus: int | None = None, now: bool = False,
          recheck: bool = False, stop_after: int | None = None) -> TrainResult:
    """Push the project, check the machine, write the run's config, start the payload under tmux.
    `recheck`: the preflight looks again even where the environment is the one it checked before.
    `env_names`: variables passed from here to the job; their values are never recorded. `gpus`:
    the GPUs of a node it waits for in the cluster's queue (default all); `now`: start beside the
    runs there, without waiting; `stop_after`: the run ends after that many epochs (a plan's probe)."""
    secret_env = env_values(s, tuple(env_names))
    project, loaded, entry = push.check_project(s, project)
    data = push.check_data(data)
    with s.cluster_lock(s.resolve_cluster(cluster), progress) as record:
        if record.state != "up":  # a `down` released it while this command waited
            raise NotFoundError(f"cluster {record.name!r} was released while this train waited for it",
                                "Start one with `gpuctl up`, then train again.")
        guards.check_for(s, loaded, record)
        with s.working(record, "train"):  # the push and the preflight are not idleness
            return _start(s, loaded, project, record, entry, args, data, allow_cpu, progress, down_after_run,
                          secret_env, gpus, now, recheck, stop_after)


def _start(s: Session, loaded: LoadedSettings, project: Path, record: ClusterRecord, entry: str, args: tuple[str, ...],
           data: Path | None, allow_cpu: bool, progress: Progress, down_after_run: bool | None,
           secret_env: dict[str, str], gpus: int | None = None, beside: bool = False,
           recheck: bool = False, stop_after: int | None = None) -> TrainResult:
    settings = loaded.settings
    first = nodes.of(s, record)
    nodes.refuse_budget(first, settings.train.budget_usd)  # before the push
    node_gpus = queue.gpus_of(first[0].host, lambda why: progress(f"note: {why}"))
    want = queue.asked(gpus, node_gpus, len(first))
    run_id = f"{push.slug(project.name)}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    paths = jobs.JobPaths(posixpath.join(first[0].host.root, "runs", run_id))
    # The project's own gpuctl.toml may pin its TensorFlow; otherwise the cluster's (`up --tf`)
    # holds: a user-wide setting or variable was already the cluster's default at `up`.
    project_file = str(project / PROJECT_FILE)
    asked = settings.train.tensorflow if loaded.sources.get("train.tensorflow") == project_file else None
    each = nodes.prepare(s, record, project, data, progress, asked, check=not first[0].host.local, recheck=recheck)
    for node in each:
        report = node.env.report if node.env is not None else None
        refusal = preflight.verdict(report, allow_cpu) if report is not None else None
        if refusal:
            raise RemoteError(f"not starting on {node.host.label}: {refusal}",
                              "Pass --allow-cpu to train on the CPU anyway, or `gpuctl down` and `gpuctl up` "
                              "again with `remote.python` set to the Python that has TensorFlow with GPU support.")
    chief = each[0]
    nodes.check_group(each, nodes.keras_for(settings.train.keras, len(each)), settings.train.budget_usd, progress)
    now = time.time()
    # The run is billed at every node's rate: its epochs cost seconds x their sum; on one node, at
    # its share (GPUs held / the node's), which the instance confirms when the run leaves the queue.
    rate = nodes.rate(each) * (want / queue.slots(node_gpus) if len(each) == 1 else 1.0)
    run = RunRecord(run_id=run_id, cluster=record.name, cluster_id=record.id, project=str(project), entry=entry,
                    args=tuple(args), state="starting", started_at=now, usd_per_hour=rate,
                    run_dir=paths.run_dir, tf_log_level=settings.train.tf_log_level,
                    budget_usd=settings.train.budget_usd, env_names=tuple(secret_env),
                    tensorflow=chief.env.tensorflow if chief.env else None, image=_image(chief.inst),
                    data=str(data) if data else None, segments=(segment_on([n.inst for n in each], now, rate),), nodes=len(each),
                    gpus=want, now=beside,
                    start_timeout_s=settings.train.start_timeout_s if len(each) > 1 else 0.0)
    # train --down counts runs that end after this moment (the instance's clock): taken before the
    # job starts, so a script that fails at once still ends the spend after the grace.
    down_after = down_after_run if down_after_run is not None else settings.guards.down_after_run
    armed_at = guards.instance_now(chief.host) if down_after else None
    run = launch_job(s, loaded, record, run, each, secret_env, stop_after=stop_after)
    # The job starts while a new cluster's watchdog does (each takes ~0.1 s to answer), so its
    # place in the queue is there to read once the watchdog's first look is.
    progress(f"watchdog: {guards.install(s, loaded, record, down_after_run, armed_at)}")
    run = _placed(s, chief.host, run)
    s.ledger.event("train", f"started {entry} in {project}" + (f" on {len(each)} nodes" if len(each) > 1 else ""),
                   cluster=record, run_id=run_id)
    return TrainResult(run=run, code_sync=chief.code, data_sync=chief.data, session=run_id, host=chief.host.label,
                       node_gpus=node_gpus)


def _placed(s: Session, host: Host, run: RunRecord, within_s: float = 10.0) -> RunRecord:
    """The run as the instance's queue placed it (queued with its position, or running), once the
    queue has answered (the job writes its place first thing, tens of ms after its start); as it
    was after `within_s`."""
    try:
        place = poll(lambda: queue.look(host, run.run_dir), within_s, first_delay_s=0.02, max_delay_s=0.2)
    except TimedOut:
        return run
    if place["state"] == "queued":
        run = run.model_copy(update={"state": "queued", "queue_position": place.get("position")})
        s.ledger.put_run(run)
    return run


def segment_on(group: list[InstanceRecord], at: float, usd_per_hour: float | None = None) -> Segment:
    """A run's stretch on these instances, chief first (`usd_per_hour`: all of theirs), from `at`."""
    inst = group[0]
    return Segment(instance_id=inst.id, node_ids=tuple(i.id for i in group[1:]), zone=inst.zone, market=inst.market,
                   usd_per_hour=inst.usd_per_hour if usd_per_hour is None else usd_per_hour, started_at=at)


def launch_job(s: Session, loaded: LoadedSettings, record: ClusterRecord, run: RunRecord, each: list[nodes.Node],
               secret_env: dict[str, str], resumed: bool = False, stop_after: int | None = None) -> RunRecord:
    """Write the run's config on every node and start its job there (node 0, the chief, reports and
    checkpoints for the run); the run, running. `resumed`: the run goes on from its checkpoint
    (restored from the store on a new instance); `stop_after`: it ends after that many epochs."""
    settings = loaded.settings
    store = s.provider(record.spec).checkpoint_store()
    target = store.target(record.spec.store_place) if store is not None else None
    extra = nodes.job_env(each, nodes.keras_for(settings.train.keras, len(each)))

    def configure(node: nodes.Node) -> list[str]:
        payload_dir = guards.push_payload(node.host)
        chief, paths = node.rank == 0, node.paths(run)
        node_gpus = queue.gpus_of(node.host)
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
            # The job waits its turn in the node's queue first (a multi-node run takes whole nodes).
            queue=queue.config(node.host, min(run.gpus, queue.slots(node_gpus)) if run.gpus and len(each) == 1
                               else queue.slots(node_gpus), node_gpus,
                               node.inst.usd_per_hour if len(each) == 1 else run.usd_per_hour, run.now),
        )
        config_path = posixpath.join(paths.run_dir, RUN_CONFIG_FILE)
        node.host.write_text(config_path, config.to_json())
        return [node.python, posixpath.join(payload_dir, queue.PAYLOAD), config_path,
                posixpath.join(payload_dir, LAUNCHER), *run.args]

    _refuse_released(s, record)
    commands = nodes.each(each, configure)
    s.ledger.put_run(run)
    try:
        _refuse_released(s, record)
        for node, command, more in zip(each, commands, extra):
            paths = node.paths(run)
            env = {"GPUCTL_RUN_ID": run.run_id, "GPUCTL_RUN_DIR": paths.run_dir, "GPUCTL_OUTPUT_DIR": paths.outputs,
                   # TensorFlow's C++ start-up chatter (oneDNN, cuInit, absl) is not the user's output.
                   "TF_CPP_MIN_LOG_LEVEL": str(run.tf_log_level), **more}
            if node.data_dir:
                env["GPUCTL_DATA_DIR"] = node.data_dir
            jobs.start_job(node.host, run.run_id, node.code_dir, command, env, paths, secret_env)
        _refuse_released(s, record)  # a `down` went ahead while this command was held up (Ctrl-Z)
    except BaseException:
        # A run on some nodes only would wait for the others forever. Every node is stopped, not
        # only those whose start returned: one may have started before its connection dropped.
        try:
            nodes.stop(each, run, must=False)  # a node whose tmux fails: the start's own error says more
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


def _image(inst: InstanceRecord) -> str | None:
    if not inst.image_id:
        return None
    return f"{inst.image_name} ({inst.image_id})" if inst.image_name else inst.image_id


def pull(s: Session, run_id: str | None, dest: Path) -> PullResult:
    """Bring a run's outputs, reports and log back from its instance, or from where its released
    cluster's provider kept them (local: the gpuctl home)."""
    run = s.find_run(run_id)
    kept = s.kept_run(run) if s.live_cluster_of(run) is None else None
    cluster = None if kept else s.run_on_live_cluster(run.run_id)[1]
    target = Path(dest) / run.run_id
    if target.resolve().is_relative_to(s.home.resolve()):
        raise ConfigError(f"--dest {str(dest)!r} is inside gpuctl's home ({s.home})",
                          "Pull to a directory of your own, e.g. the default ./gpuctl-runs.")
    try:
        target.mkdir(parents=True, exist_ok=True)  # before the host is asked anything
    except OSError as exc:
        raise ConfigError(f"cannot write to --dest {str(dest)!r}: {exc.strerror}",
                          "Pass a directory you can write to (it is created if missing).") from None
    if kept is not None:
        files, skipped = kept[0].pull_tree(kept[1], target)
        return PullResult(run_id=run.run_id, dest=str(target), files=files, skipped=skipped)
    s.connect_timeout_s = s.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S  # a live run's host answers, or we say so
    _, host = s.host(cluster)
    with s.working(cluster, "pull"):
        files, skipped = host.pull_tree(run.run_dir, target)
    return PullResult(run_id=run.run_id, dest=str(target), files=files, skipped=skipped)


def exec_command(s: Session, command: tuple[str, ...], cluster: str | None = None) -> list[ExecResult]:
    """Run a command on every host of the cluster, in parallel."""
    if not command:
        raise ConfigError("no command given", "Put the command after --, e.g. `gpuctl exec -- nvidia-smi`.")
    # One argument is a shell line, as `ssh HOST -- 'a; b'` takes it; several are words (quoted).
    argv = ["sh", "-c", command[0]] if len(command) == 1 else list(command)
    record = s.resolve_cluster(cluster)
    pairs = s.hosts(record)
    def one(host: Host) -> ExecResult:
        try:
            # The user's own command runs as long as it runs (Ctrl-C ends it): no deadline; and
            # all it prints comes back, as over `ssh` (what gpuctl's own commands print is capped).
            r = host.run(argv, check=False, timeout=NO_DEADLINE, output_limit=None)
        except RemoteError as exc:  # this host's connection went (a reboot, say): the others' output stands
            return ExecResult(host=host.label, returncode=255, stdout="", stderr=exc.message + "\n")
        return ExecResult(host=host.label, returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    with s.working(record, "exec"), ThreadPoolExecutor(max_workers=min(16, len(pairs))) as pool:
        return list(pool.map(lambda p: one(p[1]), pairs))


__all__ = ["exec_command", "log_tail", "logs", "pull", "refresh", "sync", "train", "wait"]
