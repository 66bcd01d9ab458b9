"""Runs: push a project (`sync`), start it (`train`: the stages in stages.py), bring its outputs
back (`pull`), run a command on every host (`exec`). Following a run lives in run_state.py."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuctl.config.load import LoadedSettings
from gpuctl.errors import ConfigError, DataError, NotFoundError, RemoteError
from gpuctl.model.data import S3Source, is_s3, parse_s3
from gpuctl.model.snapshots import is_snapshot
from gpuctl.model.records import RunRecord
from gpuctl.model.requests import TrainRequest
from gpuctl.model.results import ExecResult, PullResult, SyncResult, TrainResult
from gpuctl.ops import datasets, guards, nodes, push, snapshots, stages
from gpuctl.ops.run_state import log_tail, logs, refresh, wait  # noqa: F401  (the run use cases, in one place)
from gpuctl.ops.session import Progress, Session, each, quiet
from gpuctl.payloads.gpuctl_protocol import RUN_DATA_DIR
from gpuctl.provision import CheckpointStore
from gpuctl.remote.host import NO_DEADLINE, Host


def sync(s: Session, project: Path, cluster: str | None = None, data: Path | None = None,
         progress: Progress = quiet) -> SyncResult:
    """Push the project (and data) to every node of the cluster without starting anything; the
    chief's figures."""
    project, data = push.project_dir(project), push.check_data(data)
    record = s.resolve_cluster(cluster)
    group = nodes.of(s, record)
    with s.working(record, "push"):
        pushed = each(group, lambda n: push.push_all(n.host, project, data,
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


def train(s: Session, req: TrainRequest, progress: Progress = quiet) -> TrainResult:
    """Push the project, check the machine, write the run's config, start the payload under tmux:
    every stage of ops/stages.py, on the cluster held under its lock. `req.env_names`: variables
    passed from here to the job; their values are never recorded."""
    secret_env = env_values(s, req.env_names)
    project, loaded, entry = push.check_project(s, req.project)
    source, origin = data_source(s, req, loaded)  # a malformed s3:// URL, an unknown gpuctl:NAME: before anything else
    req = req.model_copy(update={"data": push.check_data(req.data)})
    cluster = s.resolve_cluster(req.cluster)
    if req.data is not None and snapshots.uploads_dirs(loaded, cluster.spec.provider):
        # `[data] upload_dirs`: DIR goes up once (changed files only) and each node fetches it in-region.
        source, origin = snapshots.upload_for_train(s, req.data, cluster.spec.scope, progress)
        req = req.model_copy(update={"data": None})
    # From here, with the user's credentials, before the cluster is touched: the bucket, the objects.
    fetch = datasets.check(s, source, s.provider(cluster.spec).data_region(), progress, origin) \
        if source is not None else None
    with s.cluster_lock(cluster, progress) as record:
        if record.state != "up":  # a `down` released it while this command waited
            raise NotFoundError(f"cluster {record.name!r} was released while this train waited for it",
                                "Start one with `gpuctl up`, then train again.")
        guards.check_for(s, loaded, record)
        with s.working(record, "train"):  # the push and the preflight are not idleness
            return stages.start_new(s, req, loaded, project, entry, record, secret_env, progress, fetch)


def data_source(s: Session, req: TrainRequest, loaded: LoadedSettings) -> tuple[S3Source | None, str]:
    """The S3 data set of `train --data s3://...` (or `gpuctl:NAME`, a snapshot `data push` made),
    else of `[train] data` when no --data was given (and the file that set it); DataError when
    the URL is malformed, NotFoundError for a snapshot there is none of."""
    text, origin = req.data_url, ""
    if text is None and req.data is None and loaded.settings.train.data:
        text, origin = loaded.settings.train.data, loaded.sources.get("train.data", "")
    if text is None:
        return None, ""
    if is_snapshot(text):
        return snapshots.resolve(s, text), (f"{text}, {origin}" if origin else text)
    return parse_s3(text), origin


def refuse_s3(data: str | None, command: str) -> None:
    """`sync` and `plan` push a local directory only: an S3 data set is `train`'s to fetch."""
    if data is not None and (is_s3(data) or is_snapshot(data)):
        shown = "gpuctl:NAME" if is_snapshot(data) else f"{data.split('/')[0]}//..."
        raise DataError(f"`gpuctl {command} --data` takes a local directory; {shown} is fetched "
                        "by `gpuctl train --data` itself",
                        "Train with `gpuctl train PROJECT --data s3://BUCKET/PREFIX` (docs/data.md).")


def pull(s: Session, run_id: str | None, dest: Path) -> PullResult:
    """Bring a run's outputs, reports and log back from its instance, or from where its released
    cluster's provider kept them (local: the gpuctl home)."""
    run = s.find_run(run_id)
    live = s.live_cluster_of(run)
    # Where its files are: its live cluster, where its released cluster's provider kept them
    # (local: the gpuctl home), or that cluster's checkpoint store (aws: each save put them there).
    kept = s.kept_run(run) if live is None else None
    stored = _store_of(s, run) if live is None and kept is None else None
    if live is None and kept is None and stored is None:
        s.run_on_live_cluster(run.run_id)  # says the cluster is down, and what is kept
    target = Path(dest) / run.run_id
    if target.resolve().is_relative_to(s.home.resolve()):
        raise ConfigError(f"--dest {str(dest)!r} is inside gpuctl's home ({s.home})",
                          "Pull to a directory of your own, e.g. the default ./gpuctl-runs.")
    try:
        target.mkdir(parents=True, exist_ok=True)  # before the host is asked anything
    except OSError as exc:
        raise ConfigError(f"cannot write to --dest {str(dest)!r}: {exc.strerror}",
                          "Pass a directory you can write to (it is created if missing).") from None
    # The run's copy of its data set stays: it came from here (or a bucket) and can be many GB.
    leave_out = (RUN_DATA_DIR,)
    if stored is not None:
        files, skipped = stored[0].download(stored[1], run.run_id, target, leave_out)
    elif kept is not None:
        files, skipped = kept[0].pull_tree(kept[1], target, leave_out)
    else:
        assert live is not None
        s.connect_quickly()  # a live run's host answers, or we say so
        _, host = s.host(live)
        with s.working(live, "pull"):
            files, skipped = host.pull_tree(run.run_dir, target, leave_out)
    return PullResult(run_id=run.run_id, dest=str(target), files=files, skipped=skipped,
                      left_out=(f"{RUN_DATA_DIR}/",) if run.data else ())


def _store_of(s: Session, run: RunRecord) -> tuple[CheckpointStore, str] | None:
    """(the store, the cluster's place in it) where a released cluster's store keeps the run's files."""
    try:
        spec = s.ledger.cluster(run.cluster_id).spec
    except KeyError:
        return None
    store = s.provider(spec).checkpoint_store()
    if store is None or not store.files(spec.store_place, run.run_id):
        return None
    return store, spec.store_place


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
