"""Releasing clusters: `down` (the jobs stopped, unpulled runs named or pulled, every resource
released, the ledger closed), `down --all` (whatever any provider holds that gpuctl tagged), and
the release of a cluster a use case launched for itself (a bake's, a plan's probe).

Nothing an instance says may stop `down` from ending the spend: a host that hangs or lies costs a
deadline, then the provider releases the machine anyway.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpuctl.errors import ConfigError, GpuctlError, RemoteError
from gpuctl.model.records import ENDED_STATES, FINAL_RUN_STATES, ClusterRecord, Resource
from gpuctl.model.results import DownQuestion, DownResult, Kept
from gpuctl.model.specs import parse_spec
from gpuctl.ops import archive, runs, stop
from gpuctl.ops.clusters import reconcile
from gpuctl.ops.session import BRAKE_LOCK_S, Progress, Session, quiet
from gpuctl.provision import PROVIDERS, Provider, foreign_error, provider_class


def release_own(s: Session, name: str, progress: Progress, saying: str) -> str | None:
    """Release a cluster a use case launched for itself (an image bake's, a plan's probe) however
    that use case ended, saying `saying` first. A release that fails is said, with what releases
    it later, and returned (that line), not raised: the use case's own error is the one to show."""
    if s.ledger.live_cluster(name) is None:
        return None  # the launch created nothing (and left no cluster)
    progress(saying)
    try:
        down(s, name, progress, force=True)
    except GpuctlError as exc:
        said = (f"could not release {name}: {exc.message}; `gpuctl down {name} -y` (or `gpuctl down --all -y`) "
                "releases it")
        progress(said)
        return said
    return None


def down_target(s: Session, name: str | None) -> str | None:
    """The live cluster `down [NAME]` would release (to confirm first); None when none is live."""
    if name is None and not s.ledger.clusters(include_down=False):
        return None
    if name and s.ledger.live_cluster(name) is None:
        return None
    return s.resolve_cluster(name).name


def down_question(s: Session, target: str) -> DownQuestion:
    """What `down` asks before it releases the live cluster `target`: what becomes of its runs'
    files (kept, left on the hosts, or gone with the instance), as its provider says, and the runs
    whose files exist only on the instance (asked of the ledger: nothing is dialled)."""
    cluster = s.ledger.live_cluster(target)
    if cluster is None:
        return DownQuestion(cluster=target)
    files = s.provider(cluster.spec).run_files()
    # Where the release deletes the runs' files (its provider keeps none), every run of the cluster.
    lost = s.ledger.runs(cluster.id) if files.kept == "on_instance" else []
    return DownQuestion(cluster=target, files=files, unpulled=tuple(r.run_id for r in lost))


def down(s: Session, name: str | None = None, progress: Progress = quiet, force: bool = False,
         pull_to: Path | None = None) -> DownResult:
    """Stop every job of the cluster, keep its reports and logs, and release all it holds. With
    `force`, a cluster whose hosts do not answer is released all the same (and says what may be
    left running on them). With `pull_to`, every run of the cluster is pulled there first (after
    its jobs stopped); a pull that fails stops the release, unless `force`."""
    if name is None and not s.ledger.clusters(include_down=False):
        # Nothing is up, but the latest cluster may have left something: a `down` interrupted
        # after its instances ended, or a guard's poweroff, leaves the group and key pair.
        latest = s.ledger.clusters()[-1:]
        try:
            leftovers = release_everything(s, latest[0], progress) if latest else []
        except GpuctlError:
            leftovers = []  # nothing asked for was up; `status --all` shows what may be left
        return DownResult(cluster=latest[0].name if leftovers else "", already_down=not leftovers,
                          released=tuple(leftovers))
    if name and s.ledger.live_cluster(name) is None:
        ended = [c for c in s.ledger.clusters() if c.name == name]
        if ended:
            # Closed already (e.g. its guard powered it off): still release what is left of it,
            # such as its security group and key pair.
            leftovers = release_everything(s, ended[-1], progress)
            # Said in the ledger: a recovery between its tries (a spot run's cluster closed by
            # EC2's word) must not bring back what the user released.
            s.ledger.event("down", f"released {len(leftovers)} resource(s) left", cluster=ended[-1])
            return DownResult(cluster=name, already_down=not leftovers, released=tuple(leftovers))
    # A host that does not answer costs one short wait: `down` refuses then, or with --force releases.
    s.connect_quickly()
    return _down_cluster(s, s.resolve_cluster(name), progress, must_stop_jobs=not force, pull_to=pull_to)


def _down_cluster(s: Session, cluster: ClusterRecord, progress: Progress, must_stop_jobs: bool = True,
                  pull_to: Path | None = None) -> DownResult:
    # A train starting a job on this cluster finishes starting first (then its run is stopped
    # here), or waits and finds the cluster down: never a job that down did not see.
    with s.cluster_lock(cluster, progress, wait_s=BRAKE_LOCK_S) as cluster:
        if cluster.state != "up":
            return DownResult(cluster=cluster.name, already_down=True)
        return _release_up_cluster(s, cluster, progress, must_stop_jobs, pull_to)


def _pull_runs(s: Session, cluster: ClusterRecord, dest: Path, progress: Progress, must: bool) -> list[str]:
    """`down --pull`: each run of the cluster brought back to `dest`; the ones pulled. A failure
    stops the release when `must` (nothing is released yet), else it is said and skipped."""
    pulled = []
    for run in s.ledger.runs(cluster.id):
        try:
            result = runs.pull(s, run.run_id, dest)
        except GpuctlError as exc:
            if must:
                raise type(exc)(f"cannot pull run {run.run_id} before releasing {cluster.name!r}: {exc.message}; "
                                  "nothing released", f"Fix that and rerun, or release it anyway: `gpuctl down "
                                  f"{cluster.name} --force -y` (what was not pulled may go with it).") from None
            progress(f"{run.run_id}: not pulled ({exc.message}); releasing anyway")
            continue
        progress(f"pulled run {run.run_id}: {result.files} file(s) into {result.dest}")
        pulled.append(run.run_id)
    return pulled


def _release_up_cluster(s: Session, cluster: ClusterRecord, progress: Progress, must_stop_jobs: bool,
                        pull_to: Path | None = None) -> DownResult:
    # The brake: nothing that records may hold the release. A ledger that cannot take a write (a
    # full disk) is skipped and said; logs are read (bounded) before and written after it.
    with s.ledger.unrecorded() as missed:
        # What the provider knows first: an instance that ended by itself keeps its own end time.
        cluster = reconcile(s, cluster)
        stopped: list[str] = []
        unconfirmed: list[str] = []
        why: str | None = None
        if cluster.state == "up":
            try:
                # A host that answered but then hung is not waited for: its runs are named, and the
                # release below ends what runs there (the instance itself, or the cluster's processes).
                stopped, unconfirmed, why = stop.stop_runs(s, cluster)
            except GpuctlError as exc:
                if must_stop_jobs:
                    raise RemoteError(f"cannot stop the jobs of cluster {cluster.name!r}: {exc.message}",
                                      f"Release it anyway: `gpuctl down {cluster.name} --force -y` (what runs on a "
                                      "host that does not answer may stay there).") from None
                unconfirmed = [r.run_id for r in s.ledger.runs(cluster.id) if r.state not in FINAL_RUN_STATES]
                why = exc.message
            if why is not None:
                progress(f"{cluster.name}: jobs not confirmed stopped ({why}); releasing anyway")
        pulled = _pull_runs(s, cluster, pull_to, progress, must_stop_jobs) if pull_to is not None else []
        logs = archive.take(s, cluster, progress)
        with s.releasing(cluster):
            resources = release_everything(s, cluster, progress)
        close_in_ledger(s, cluster, f"released {len(resources)} resource(s)")
        if s.ledger.cluster(cluster.id).state == "down":  # recorded: the ledger says it from now on
            s.settle_release(cluster)
        archive.keep(s, logs, progress)
    if missed:
        progress(f"{cluster.name}: released, but not recorded in the ledger ({missed[0]}); `gpuctl status` may show "
                 f"it up until `gpuctl down {cluster.name} -y` runs again with room on that disk")
    return DownResult(cluster=cluster.name, stopped_runs=tuple(stopped), pulled=tuple(pulled),
                      released_instances=tuple(r.id for r in resources if r.kind in ("instance", "workdir")),
                      released=tuple(resources), unconfirmed_runs=tuple(unconfirmed), unconfirmed_why=why,
                      unrecorded=tuple(missed))


def release_everything(s: Session, cluster: ClusterRecord, progress: Progress) -> list[Resource]:
    """Everything the provider still finds of the cluster, released; what was found. The brake:
    when the search fails (the cloud answers an error), the instances the ledger knows are
    released all the same, then the search's error is raised (the cluster stays up in the ledger)."""
    provider = s.provider(cluster.spec)
    known = s.ledger.instances(cluster.id)
    region = next((i.region for i in known if i.region), None) or cluster.spec.scope
    try:
        resources = provider.discover(cluster.name, region)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the spend it knows of ends first
        live = [Resource(provider=cluster.provider, kind="instance", id=i.id, region=i.region, cluster=cluster.name)
                for i in known if i.state not in ENDED_STATES]
        err = exc if isinstance(exc, GpuctlError) else foreign_error(exc)
        said = err.message if err is not None else f"{type(exc).__name__}: {exc}"
        progress(f"{cluster.name}: could not look up all it holds ({said}); ending its "
                 f"{len(live)} instance(s) the ledger knows")
        provider.release(live, progress, frozenset(s.unreachable_ids))
        if err is None or err is exc:
            raise
        raise err from exc
    provider.release(resources, progress, frozenset(s.unreachable_ids))
    return resources


def close_in_ledger(s: Session, cluster: ClusterRecord, message: str) -> None:
    """Mark the cluster's instances ended and the cluster down. An instance whose end is known
    already (from EC2, say) keeps that time: billing closes when it really ended."""
    now = time.time()
    instances = s.ledger.instances(cluster.id)
    for i in instances:
        if i.state != "terminated" or i.terminated_at is None:
            s.ledger.put_instance(cluster.id, i.model_copy(update={"state": "terminated",
                                                                  "terminated_at": i.terminated_at or now}))
    s.ledger.mark_cluster_down(cluster.id, max([i.terminated_at or now for i in instances], default=now))
    s.ledger.event("down", message, cluster=cluster)


def searcher(s: Session, name: str) -> Provider:
    """A provider to search everything of `name` with: the current settings say where (region,
    profile); settings that could not launch a cluster (no ssh hosts, say) still can search."""
    settings = s.settings().settings.model_copy(update={"provider": name})
    try:
        spec = provider_class(name).spec_from_settings(settings)
    except ConfigError:
        spec = parse_spec({"name": settings.cluster, "provider": name})
    return s.provider(spec)


def live_in_ledger(s: Session, say: Progress) -> list[ClusterRecord]:
    """The ledger's live clusters, or none (said) when the ledger cannot be read: `status --all`
    and `down --all` still find what runs by the providers' own tags."""
    try:
        return s.ledger.clusters(include_down=False)
    except ConfigError as exc:
        say(f"{exc.message}; looking by the providers' tags only")
        return []


def down_all(s: Session, progress: Progress = quiet, any_owner: bool = False) -> DownResult:
    """Release every cluster the ledger knows (each with the spec it was launched with), then
    everything else each provider finds by its tags with the current settings (orphans of a lost
    ledger). A cluster is closed in the ledger only once its resources are released. What belongs
    to no cluster of this install (a provider's resource of another owner has none) is released
    only with `any_owner`."""
    released: list[Resource] = []
    stopped: list[str] = []
    failed: list[tuple[str, GpuctlError]] = []
    s.connect_quickly()  # as `down`: one short wait a host
    for c in live_in_ledger(s, progress):
        try:
            result = _down_cluster(s, c, progress, must_stop_jobs=False)
        except GpuctlError as exc:
            progress(f"{c.name}: not released: {exc.message}")
            failed.append((c.name, exc))
            continue
        released += result.released
        stopped += result.stopped_runs
    for name in PROVIDERS:
        try:
            provider = searcher(s, name)
            found = provider.discover()
        except GpuctlError as exc:
            progress(f"{name}: not searched: {exc.message}")
            continue
        others = [r for r in found if r.cluster is None]
        if others and not any_owner:
            found = [r for r in found if r.cluster is not None]
            progress(f"{name}: left {len(others)} resource(s) of other owners; "
                     "`gpuctl down --all --any-owner` releases them too")
        try:
            provider.release(found, progress)
        except GpuctlError as exc:
            progress(f"{name}: not released: {exc.message}")
            failed.append((name, exc))
            continue
        released += found
    if failed:
        first = failed[0][1]
        raise type(first)("not released: " + "; ".join(f"{n} ({e.message})" for n, e in failed),
                          "Fix that and rerun `gpuctl down --all -y`; `gpuctl status --all` shows what is left.")
    return DownResult(cluster="*", already_down=not released, stopped_runs=tuple(stopped),
                      released_instances=tuple(r.id for r in released if r.kind in ("instance", "workdir")),
                      released=tuple(released), kept=kept(s, progress))


def kept(s: Session, progress: Progress = quiet) -> tuple[Kept, ...]:
    """What `down --all` leaves because it holds data, from the ledger: volumes and data sets.
    A ledger that cannot say changes nothing of what was released (said, not raised)."""
    from gpuctl.model.data import size_text
    from gpuctl.ops import snapshots, volumes

    found: list[Kept] = []
    try:
        found += [Kept(kind="volume", name=v.name, size=f"{v.size_gb} GB", usd_per_month=v.monthly_usd,
                       remove=f"gpuctl volume rm {v.name}") for v in volumes.kept(s)]
        found += [Kept(kind="data set", name=d.name, size=size_text(d.bytes), usd_per_month=d.monthly_usd,
                       remove=f"gpuctl data rm {d.name}") for d in snapshots.kept(s)]
    except GpuctlError as exc:
        progress(f"Volumes and data sets not listed: {exc.message}")
    return tuple(found)
