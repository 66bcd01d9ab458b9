"""Clusters: `up` (a new cluster, or the one of that name reused), its price and the spend question,
and bringing a cluster's instance states from its provider into the ledger. `down` is release.py.

Every use case checks its inputs before it creates or destroys anything, so a bad input leaves the
ledger and the instances exactly as they were; an `up` that created nothing leaves no row.
"""

from __future__ import annotations

import math
import sqlite3
import time
from typing import Callable

from gpuctl.config import tf_releases
from gpuctl.errors import ConfigError, ConflictError, GpuctlError
from gpuctl.model.records import ENDED_STATES, ClusterRecord, InstanceRecord, PriceQuote
from gpuctl.model.requests import UpRequest
from gpuctl.model.results import LaunchQuestion, TfEnv, UpResult
from gpuctl.model.specs import ClusterSpec
from gpuctl.model.volumes import ENV_VAR as VOLUME_ENV
from gpuctl.ops import guards, setup, workdirs
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.provision import Provider, provider_class, spec_from_settings


def _rate(usd_per_hour: float | None) -> float | None:
    if usd_per_hour is not None and not (math.isfinite(usd_per_hour) and 0 <= usd_per_hour <= 1e6):
        raise ConfigError(f"--usd-per-hour {usd_per_hour!r} is not a price",
                          "Give the dollars an hour of the machine costs: a number from 0 to 1000000.")
    return usd_per_hour


def _asked(s: Session, usd_per_hour: float | None, take: bool = False, volume: str | None = None) -> ClusterSpec:
    """The spec `up` launches: the question before the launch is about the very spec launched
    (one launch token, one provider and what it read). The launch `take`s it: a later `up` of the
    same session makes a new one (its own launch token and checkpoint place). `volume`: `up
    --volume`'s, checked and recorded in it (aws: it picks the zone) before anything is asked."""
    spec = s.launch_specs.pop(usd_per_hour, None)
    if spec is None:
        spec = spec_from_settings(s.settings().settings, _rate(usd_per_hour))
        if spec.tensorflow:  # a version that does not exist fails here, not after an instance boots
            tf_releases.check(spec.tensorflow)
        if volume is not None:
            from gpuctl.ops import volumes

            spec = volumes.for_up(s, spec, volume)
    if not take:
        s.launch_specs[usd_per_hour] = spec
    return spec


def launch_question(s: Session, usd_per_hour: float | None = None, volume: str | None = None) -> LaunchQuestion | None:
    """What `up` asks the user to confirm before it spends money; None when it bills nothing (no
    price quote: machines of the user's own, a free local cluster) or reuses what runs."""
    spec = _asked(s, usd_per_hour, volume=volume)
    caps = provider_class(spec.provider).capabilities
    if s.ledger.live_cluster(spec.name) is not None and caps.reuses_live_clusters:
        return None  # reusing what runs already costs nothing new
    quote = s.provider(spec).price_quote()
    if quote is None:
        return None
    picks = caps.picks_instance_types
    return LaunchQuestion(cluster=spec.name, provider=spec.provider, nodes=spec.nodes,
                          instance_type=spec.instance_type if picks else None,
                          market=("spot" if spec.interruptible else "on-demand") if picks else None, quote=quote,
                          max_hours=spec.max_hours, budget_usd=s.settings().settings.guards.budget_usd)


def priced(s: Session) -> tuple[ClusterSpec, PriceQuote | None]:
    """The spec `up` would launch with this session's settings and the $/h it would bill (None:
    nothing), found before anything is created: an unknown type or a cap no zone meets fails here."""
    spec = _asked(s, None)
    return spec, s.provider(spec).price_quote()


Told = Callable[[InstanceRecord], None]


def _told_nothing(_: InstanceRecord) -> None:
    pass


def up(s: Session, req: UpRequest | None = None, progress: Progress = quiet, told: Told = _told_nothing) -> UpResult:
    """Create the cluster named by the `cluster` setting (or find and reuse it) and make it the
    default (unless `req.make_default` is False: an image bake's cluster is nobody's default).
    `req.launched_for`: the use case launching it for itself (ClusterSpec.launched_for). The
    settings `req`'s flags set are the Session's (`UpRequest.flags`, given when it was opened).

    Each instance is in the ledger from the moment its provider gave its id, so a failed or
    interrupted `up` leaves nothing billing that `status`, `cost` and `down` do not see. `told`
    hears every instance of the cluster as `up` comes to hold it (created, reused, set up again),
    and again as its record changes: what a failure says still runs (the CLI's last lines)."""
    req = req or UpRequest()
    wait_ssh = req.wait_ssh
    spec = _asked(s, req.usd_per_hour, take=True, volume=req.volume)
    if req.launched_for:
        spec = spec.model_copy(update={"launched_for": req.launched_for})
    guards.check_settings(s.settings())
    live = s.ledger.live_cluster(spec.name)
    why = setup.failed(s, live) if live is not None else None
    if live is not None and why is not None:
        live = reconcile(s, live)  # its machines may have ended since: then it is a new `up`
        if live.state == "up":
            return _setup_again(s, live, spec, why, progress, wait_ssh, told)
        live = None
    if live is not None:
        spec = _reusable(s, live, spec)
        cluster = live
    else:
        s.provider(spec).check()
        try:
            # Recorded before launching, so a launch killed half-way is still known locally too.
            cluster = s.ledger.add_cluster(spec, make_default=req.make_default)
        except sqlite3.IntegrityError:
            raise ConflictError(f"a cluster named {spec.name!r} is already up") from None
    provider = s.provider(spec)
    known = {i.id: i for i in s.ledger.instances(cluster.id)}  # an `up` killed earlier recorded these
    made: dict[str, InstanceRecord] = {}

    def launched(inst: InstanceRecord) -> None:
        made[inst.id] = inst
        told(inst)  # first: what is said of a failure must not hang on the ledger's write
        s.ledger.put_instance(cluster.id, inst)

    try:
        instances = provider.launch(progress, wait_ssh, launched)
    except BaseException:
        if live is None and not any(i.state not in ENDED_STATES for i in made.values()):
            _forget_if_nothing_exists(s, provider, cluster)
        raise
    for n, inst in enumerate(instances):
        if inst.id in known and inst.id not in made:
            # Reused: what was recorded at launch (price, periods, spot steps, image) stays; only
            # what may have changed since (state, addresses) is taken from the provider.
            inst = known[inst.id].model_copy(update={"state": inst.state, "public_ip": inst.public_ip,
                                                     "private_ip": inst.private_ip})
            instances[n] = inst
        told(inst)
        s.ledger.put_instance(cluster.id, inst)
    s.ledger.event("up", f"{len(instances)} instance(s) via {spec.provider}", cluster=cluster)
    if wait_ssh and spec.volume is not None:  # on the chief, before anything else uses it
        ((_, chief), *_) = s.hosts(cluster)
        path, done = provider.mount_volume(chief)
        progress(f"volume {spec.volume.name}: {done}; the chief's jobs find it at ${VOLUME_ENV} ({path})")
    elif spec.volume is not None:  # every train's start mounts it where it is not yet (stages.start)
        progress(f"volume {spec.volume.name}: mounted on the chief by the first `gpuctl train` (--no-wait)")
    if wait_ssh and len(instances) > 1:  # nodes that see one work dir (a shared home) each get their own
        instances = workdirs.separate(s, cluster, provider, progress)
    return _armed_and_set_up(s, cluster, provider, instances, progress, wait_ssh, reused=live is not None)


def _armed_and_set_up(s: Session, cluster: ClusterRecord, provider: Provider, instances: list[InstanceRecord],
                      progress: Progress, wait_ssh: bool, reused: bool) -> UpResult:
    given = wait_ssh and bool(cluster.spec.remote.python)
    if given:
        # The Python is known: its preflight (seconds of TensorFlow import) starts before the
        # watchdog's install and first look, not after, so a train right after `up` waits less.
        setup.warm(s, cluster)
    if provider.capabilities.arms_guard_at_up and wait_ssh:
        progress(f"watchdog: {guards.install(s, s.settings(), cluster)}")
    elif provider.capabilities.arms_guard_at_up:
        progress("watchdog: armed by the first `gpuctl train` (the boot-time hard cap is armed already)")
    envs: tuple[TfEnv, ...] = ()
    if given:
        setup.done_by_remote_python(s, cluster)
    elif wait_ssh:
        # The TensorFlow runs will use, found or installed now rather than at the first train:
        # `up` is where a user expects to wait, and a baked image proves itself here (the watchdog
        # guards the install's minutes).
        with s.working(cluster, "setup"):
            envs = setup.ensure(s, cluster, progress, check=False)
        setup.warm(s, cluster)
    return UpResult(cluster=cluster, instances=tuple(instances), reused=reused,
                    tensorflow=tuple(e for e in envs if e.how != "local"))


def _setup_again(s: Session, live: ClusterRecord, asked: ClusterSpec, why: str, progress: Progress,
                 wait_ssh: bool, told: Told) -> UpResult:
    """`up` of a live cluster whose setup failed: the same machines and TensorFlow version, set up
    again with today's `remote.*` (a `remote.python` or `remote.wheelhouse` set since is used)."""
    _refuse_other_machines(live.spec, asked)
    spec = live.spec.model_copy(update={k: getattr(asked, k) for k in ("remote", *asked.access_fields)})
    s.ledger.set_spec(live.id, spec)
    s.forget_hosts(live)  # they were made with the old remote.* (python, timeouts)
    cluster = s.ledger.cluster(live.id)
    progress(f"cluster {cluster.name!r} is up but its setup failed ({why}); setting it up again with today's settings")
    instances = [i for i in s.ledger.instances(cluster.id) if i.state not in ENDED_STATES]
    for inst in instances:
        told(inst)
    return _armed_and_set_up(s, cluster, s.provider(spec), instances, progress, wait_ssh, reused=True)


def _reusable(s: Session, live: ClusterRecord, asked: ClusterSpec) -> ClusterSpec:
    """The live cluster's own spec, if `up` may reuse it as asked (same launch token: a retried
    launch cannot start a second instance)."""
    if not provider_class(asked.provider).capabilities.reuses_live_clusters or live.provider != asked.provider:
        raise ConflictError(
            f"a cluster named {asked.name!r} is already up",
            f"Use it (`gpuctl train --cluster {asked.name} ...`), pick another --name, or `gpuctl down {asked.name}`.",
        )
    _refuse_other_machines(live.spec, asked)
    if asked.volume is not None and asked.volume != live.spec.volume:
        had = live.spec.volume.name if live.spec.volume is not None else "none"
        raise ConflictError(f"cluster {asked.name!r} is up with another volume ({had})",
                            f"`gpuctl down {asked.name} -y` first (volumes stay), or pick another --name.")
    return live.spec.model_copy(update=asked.model_dump(include=set(asked.access_fields)))


def _refuse_other_machines(have_spec: ClusterSpec, asked: ClusterSpec) -> None:
    """A ConflictError unless `asked` launches what the live cluster has (its spec's launch_fields)."""
    fields = set(asked.launch_fields | have_spec.launch_fields)
    want, have = asked.model_dump(include=fields), have_spec.model_dump(include=fields)
    if not have["tensorflow"]:  # recorded before gpuctl pinned TensorFlow: whatever it has, it keeps
        want["tensorflow"] = have["tensorflow"]
    if want != have:
        diff = ", ".join(f"{k}: {have[k]} -> {want[k]}" for k in want if want[k] != have.get(k))
        raise ConflictError(f"cluster {asked.name!r} is up with other settings ({diff})",
                            f"`gpuctl down {asked.name} -y` first, or pick another --name.")


def _forget_if_nothing_exists(s: Session, provider: Provider, cluster: ClusterRecord) -> None:
    """After a failed launch, drop the cluster from the ledger unless the provider holds something
    of it (then it stays up, so `gpuctl down` and `status` still see it)."""
    try:
        leftovers = provider.discover(cluster.name, cluster.spec.scope)
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
