"""Clusters: `up`, `down`, `down --all`, `status --all`, and bringing a cluster's instance states
from its provider into the ledger.

Every use case checks its inputs before it creates or destroys anything, so a bad input leaves the
ledger and the instances exactly as they were; an `up` that created nothing leaves no row.
"""

from __future__ import annotations

import math
import sqlite3
import time

from gpuctl.errors import ConfigError, ConflictError, GpuctlError, RemoteError
from gpuctl.ops import guards, run_state, setup
from gpuctl.ops.session import REPORT_CONNECT_TIMEOUT_S, Progress, Session, quiet
from gpuctl.provision import PROVIDERS, Provider, provider_class, spec_from_settings
from gpuctl.results import DownResult, Inventory, TfEnv, UpResult
from gpuctl.types import ENDED_STATES, ClusterRecord, ClusterSpec, Resource


def _rate(usd_per_hour: float | None) -> float | None:
    if usd_per_hour is not None and not (math.isfinite(usd_per_hour) and 0 <= usd_per_hour <= 1e6):
        raise ConfigError(f"--usd-per-hour {usd_per_hour!r} is not a price",
                          "Give the dollars an hour of the machine costs: a number from 0 to 1000000.")
    return usd_per_hour


def _asked(s: Session, usd_per_hour: float | None) -> ClusterSpec:
    return spec_from_settings(s.settings().settings, _rate(usd_per_hour))


def launch_question(s: Session, usd_per_hour: float | None = None) -> str | None:
    """What `up` asks the user to confirm before it spends money; None when it costs nothing."""
    spec = _asked(s, usd_per_hour)
    if s.ledger.live_cluster(spec.name) is not None and provider_class(spec.provider).reuses_live_clusters:
        return None  # reusing what runs already costs nothing new
    return s.provider(spec).launch_question()


def up(s: Session, progress: Progress = quiet, wait_ssh: bool = True, usd_per_hour: float | None = None,
       make_default: bool = True) -> UpResult:
    """Create the cluster named by the `cluster` setting (or find and reuse it) and make it the
    default (unless `make_default` is False: an image bake's cluster is nobody's default)."""
    spec = _asked(s, usd_per_hour)
    guards.check_settings(s.settings())
    live = s.ledger.live_cluster(spec.name)
    if live is not None:
        spec = _reusable(s, live, spec)
        cluster = live
    else:
        s.provider(spec).check()
        try:
            # Recorded before launching, so a launch killed half-way is still known locally too.
            cluster = s.ledger.add_cluster(spec, make_default=make_default)
        except sqlite3.IntegrityError:
            raise ConflictError(f"a cluster named {spec.name!r} is already up") from None
    provider = s.provider(spec)
    try:
        instances = provider.launch(progress, wait_ssh)
    except BaseException:
        if live is None:
            _forget_if_nothing_exists(s, provider, cluster)
        raise
    known = {i.id: i for i in s.ledger.instances(cluster.id)}
    for n, inst in enumerate(instances):
        if inst.id in known:
            # Reused: what was recorded at launch (price, periods, spot steps, image) stays; only
            # what may have changed since (state, addresses) is taken from the provider.
            inst = known[inst.id].model_copy(update={"state": inst.state, "public_ip": inst.public_ip,
                                                     "private_ip": inst.private_ip})
            instances[n] = inst
        s.ledger.put_instance(cluster.id, inst)
    s.ledger.event("up", f"{len(instances)} instance(s) via {spec.provider}", cluster=cluster)
    if provider.arms_guard_at_up and wait_ssh:
        progress(f"watchdog: {guards.install(s, s.settings(), cluster)}")
    elif provider.arms_guard_at_up:
        progress("watchdog: armed by the first `gpuctl train` (the boot-time hard cap is armed already)")
    envs: tuple[TfEnv, ...] = ()
    if wait_ssh and not spec.remote.python:
        # The TensorFlow runs will use, found or installed now rather than at the first train:
        # `up` is where a user expects to wait, and a baked image proves itself here.
        with s.working(cluster, "setup"):
            envs = setup.ensure(s, cluster, progress, check=False)
    return UpResult(cluster=cluster, instances=tuple(instances), reused=live is not None,
                    tensorflow=tuple(e for e in envs if e.how != "local"))


# What decides which machines a cluster gets; the rest (timeouts, remote.*) may differ on reuse.
LAUNCH_FIELDS = {"provider", "instance_type", "market", "max_price", "image", "region", "disk_gb", "nodes", "hosts",
                 "tensorflow", "base_os"}  # these two choose the image (aws) and the TF the runs get
# Who may reach the cluster: always as this `up` asks, never as an earlier (perhaps killed) one did.
ACCESS_FIELDS = {"ssh_cidr"}


def _reusable(s: Session, live: ClusterRecord, asked: ClusterSpec) -> ClusterSpec:
    """The live cluster's own spec, if `up` may reuse it as asked (same launch token: a retried
    launch cannot start a second instance)."""
    if not provider_class(asked.provider).reuses_live_clusters or live.provider != asked.provider:
        raise ConflictError(
            f"a cluster named {asked.name!r} is already up",
            f"Use it (`gpuctl train --cluster {asked.name} ...`), pick another --name, or `gpuctl down {asked.name}`.",
        )
    want = asked.model_dump(include=LAUNCH_FIELDS)
    have = live.spec.model_dump(include=LAUNCH_FIELDS)
    if not have["tensorflow"]:  # recorded before gpuctl pinned TensorFlow: whatever it has, it keeps
        want["tensorflow"] = have["tensorflow"]
    if want != have:
        diff = ", ".join(f"{k}: {have[k]} -> {want[k]}" for k in want if want[k] != have.get(k))
        raise ConflictError(f"cluster {asked.name!r} is up with other settings ({diff})",
                            f"`gpuctl down {asked.name} -y` first, or pick another --name.")
    return live.spec.model_copy(update=asked.model_dump(include=ACCESS_FIELDS))


def _forget_if_nothing_exists(s: Session, provider: Provider, cluster: ClusterRecord) -> None:
    """After a failed launch, drop the cluster from the ledger unless the provider holds something
    of it (then it stays up, so `gpuctl down` and `status` still see it)."""
    try:
        leftovers = provider.discover(cluster.name, cluster.spec.region)
    except ConfigError:
        leftovers = []  # e.g. an unknown region: nothing can exist there
    except GpuctlError:
        return  # cannot tell: keep the record, `down` will sort it out
    if not leftovers:
        s.ledger.forget_cluster(cluster.id)


def reconcile(s: Session, cluster: ClusterRecord) -> ClusterRecord:
    """Bring a cluster's instance states from its provider into the ledger; a cluster whose
    instances all ended (a guard's poweroff, a spot interruption) is closed at that time."""
    instances = s.ledger.instances(cluster.id)
    if not instances:
        return cluster
    try:
        fresh = s.provider(cluster.spec).reconcile(instances)
    except GpuctlError:
        return cluster  # cannot ask now (offline, throttled): the ledger's view stands
    before = {i.id: i for i in instances}
    for new in fresh:
        old = before[new.id]
        if new != old:
            s.ledger.put_instance(cluster.id, new)
        if new.state != old.state:
            s.ledger.event("instance-" + new.state, new.state_reason or "", cluster=cluster)
    ended = [i.terminated_at for i in fresh if i.state in ENDED_STATES]
    if len(ended) == len(fresh):
        s.ledger.mark_cluster_down(cluster.id, max(t or time.time() for t in ended))
        return cluster.model_copy(update={"state": "down"})
    return cluster


def reconcile_live(s: Session) -> None:
    """Bring every live cluster's instances up to date with its provider (status, cost)."""
    for c in s.ledger.clusters(include_down=False):
        reconcile(s, c)


def down_target(s: Session, name: str | None) -> str | None:
    """The live cluster `down [NAME]` would release (to confirm first); None when none is live."""
    if name is None and not s.ledger.clusters(include_down=False):
        return None
    if name and s.ledger.live_cluster(name) is None:
        return None
    return s.resolve_cluster(name).name


def down(s: Session, name: str | None = None, progress: Progress = quiet, force: bool = False) -> DownResult:
    """Stop every job of the cluster, keep its reports and logs, and release all it holds. With
    `force`, a cluster whose hosts do not answer is released all the same (and says what may be
    left running on them)."""
    if name is None and not s.ledger.clusters(include_down=False):
        # Nothing is up, but the latest cluster may have left something: a `down` interrupted
        # after its instances ended, or a guard's poweroff, leaves the group and key pair.
        latest = s.ledger.clusters()[-1:]
        try:
            leftovers = _release(s, latest[0], progress) if latest else []
        except GpuctlError:
            leftovers = []  # nothing asked for was up; `status --all` shows what may be left
        return DownResult(cluster=latest[0].name if leftovers else "", already_down=not leftovers,
                          released=tuple(leftovers))
    if name and s.ledger.live_cluster(name) is None:
        ended = [c for c in s.ledger.clusters() if c.name == name]
        if ended:
            # Closed already (e.g. its guard powered it off): still release what is left of it,
            # such as its security group and key pair.
            leftovers = _release(s, ended[-1], progress)
            return DownResult(cluster=name, already_down=not leftovers, released=tuple(leftovers))
    if force:
        s.connect_timeout_s = s.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S
    return _down_cluster(s, s.resolve_cluster(name), progress, must_stop_jobs=not force)


def _down_cluster(s: Session, cluster: ClusterRecord, progress: Progress, must_stop_jobs: bool = True) -> DownResult:
    # A train starting a job on this cluster finishes starting first (then its run is stopped
    # here), or waits and finds the cluster down: never a job that down did not see.
    with s.cluster_lock(cluster, progress) as cluster:
        if cluster.state != "up":
            return DownResult(cluster=cluster.name, already_down=True)
        return _release_up_cluster(s, cluster, progress, must_stop_jobs)


def _release_up_cluster(s: Session, cluster: ClusterRecord, progress: Progress, must_stop_jobs: bool) -> DownResult:
    # What the provider knows first: an instance that ended by itself keeps its own end time.
    cluster = reconcile(s, cluster)
    stopped: list[str] = []
    if cluster.state == "up":
        try:
            stopped = run_state.stop_runs(s, cluster)
        except GpuctlError as exc:
            if must_stop_jobs:
                raise RemoteError(f"cannot stop the jobs of cluster {cluster.name!r}: {exc.message}",
                                  f"Release it anyway: `gpuctl down {cluster.name} --force -y` (what runs on a host "
                                  "that does not answer may stay there).") from None
            progress(f"{cluster.name}: jobs not stopped ({exc.message}); releasing anyway")
    resources = _release(s, cluster, progress)
    _close_in_ledger(s, cluster, f"released {len(resources)} resource(s)")
    return DownResult(cluster=cluster.name, stopped_runs=tuple(stopped),
                      released_instances=tuple(r.id for r in resources if r.kind in ("instance", "workdir")),
                      released=tuple(resources))


def _release(s: Session, cluster: ClusterRecord, progress: Progress) -> list[Resource]:
    """Everything the provider still finds of the cluster, released; what was found."""
    provider = s.provider(cluster.spec)
    region = next((i.region for i in s.ledger.instances(cluster.id) if i.region), None) or cluster.spec.region
    resources = provider.discover(cluster.name, region)
    provider.release(resources, progress)
    return resources


def _close_in_ledger(s: Session, cluster: ClusterRecord, message: str) -> None:
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
        spec = ClusterSpec(name=settings.cluster, provider=name)
    return s.provider(spec)


def _live_in_ledger(s: Session, say: Progress) -> list[ClusterRecord]:
    """The ledger's live clusters, or none (said) when the ledger cannot be read: `status --all`
    and `down --all` still find what runs by the providers' own tags."""
    try:
        return s.ledger.clusters(include_down=False)
    except ConfigError as exc:
        say(f"{exc.message}; looking by the providers' tags only")
        return []


def inventory(s: Session) -> Inventory:
    """`status --all`: every resource each provider finds by itself, ledger or not."""
    resources: list[Resource] = []
    notes: list[str] = []
    known = _live_in_ledger(s, notes.append)
    live = [c.name for c in known]
    for name in PROVIDERS:
        try:
            resources += searcher(s, name).discover()
        except GpuctlError as exc:
            if any(c.provider == name for c in known):
                raise
            notes.append(f"{name}: not searched: {exc.message}")
    others = [r.id for r in resources if r.cluster is None]  # no cluster of this install: another owner's
    if others:
        notes.append(f"{len(others)} resource(s) belong to another owner (a lost gpuctl home, a colleague; their "
                     f"state says whose): {', '.join(others[:4])}{', ...' if len(others) > 4 else ''}; "
                     "`gpuctl down --all --any-owner` releases them")
    return Inventory(resources=tuple(resources), ledger_clusters=tuple(live), notes=tuple(notes))


def down_all(s: Session, progress: Progress = quiet, any_owner: bool = False) -> DownResult:
    """Release every cluster the ledger knows (each with the spec it was launched with), then
    everything else each provider finds by its tags with the current settings (orphans of a lost
    ledger). A cluster is closed in the ledger only once its resources are released. What belongs
    to no cluster of this install (a provider's resource of another owner has none) is released
    only with `any_owner`."""
    released: list[Resource] = []
    stopped: list[str] = []
    failed: list[tuple[str, GpuctlError]] = []
    for c in _live_in_ledger(s, progress):
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
        provider.release(found, progress)
        released += found
    if failed:
        first = failed[0][1]
        raise type(first)("not released: " + "; ".join(f"{n} ({e.message})" for n, e in failed),
                          "Fix that and rerun `gpuctl down --all -y`; `gpuctl status --all` shows what is left.")
    return DownResult(cluster="*", already_down=not released, stopped_runs=tuple(stopped),
                      released_instances=tuple(r.id for r in released if r.kind in ("instance", "workdir")),
                      released=tuple(released))
