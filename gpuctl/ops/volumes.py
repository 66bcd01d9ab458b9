"""Volumes: `gpuctl volume create`, `volume ls`, `volume rm`, `up --volume` (the checks and the
spec it launches with), and what volumes cost (`cost`, `status --all`, `down --all`).

A volume outlives clusters: `down` never deletes one (aws: the instance's termination detaches
it; local and ssh: a directory the release never touches). Every input is checked before anything
is created or deleted. Which provider keeps a volume is the volume's record; nothing here asks
which provider it holds (the store's `lists_its_own` says whose word is the truth).
"""

from __future__ import annotations

import time
from typing import Optional

from pydantic import BaseModel, ConfigDict

from gpuctl.errors import ConfigError, ConflictError, GpuctlError, NotFoundError
from gpuctl.model import billing
from gpuctl.model.records import ClusterRecord
from gpuctl.model.specs import ClusterSpec, parse_spec
from gpuctl.model.volumes import Volume, check_name, check_size
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.provision import VolumeStore, provider_class

PRICE = (f"${billing.GP3_USD_PER_GB_MONTH:.2f}/GB-month on aws (EBS gp3 list price, us-east-1, 2026-11); "
         "local and ssh volumes are your own disk ($0)")


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)


class VolumeInfo(Volume):
    """A volume with who uses it and what it costs."""

    used_by: str = ""  # the live cluster it is attached to (or an instance no cluster here knows)
    monthly_usd: float = 0.0  # while it exists; 0 once removed
    accrued_usd: float = 0.0  # since it was made (until removed)
    removed_at: Optional[float] = None


class VolumeList(_Result):
    volumes: tuple[VolumeInfo, ...]
    price: str = PRICE
    notes: tuple[str, ...] = ()  # a provider that could not be asked (the ledger's volumes are listed anyway)


class VolumePlan(_Result):
    """What `volume create` is about to make (asked before it does, where it costs money)."""

    name: str
    provider: str
    size_gb: int
    where: str  # aws: the zone; ssh: the host; local: ""
    monthly_usd: float


class VolumeStorage(_Result):
    """`cost` and `status --all`: what the volumes cost, from the ledger alone."""

    volumes: tuple[VolumeInfo, ...] = ()
    gb: float = 0.0  # of the volumes that exist
    usd_per_month: float = 0.0
    accrued_usd: float = 0.0  # every volume's, removed ones included
    price: str = PRICE


def info(s: Session, volume: Volume, removed_at: float | None = None, now: float | None = None,
         live: list[ClusterRecord] | None = None) -> VolumeInfo:
    end = removed_at or (time.time() if now is None else now)
    return VolumeInfo(**volume.model_dump(), removed_at=removed_at,
                      used_by="" if removed_at else used_by(s, volume, live),
                      monthly_usd=0.0 if removed_at else volume.usd_per_month,
                      accrued_usd=billing.storage_cost(volume.size_gb, volume.created_at, end, volume.usd_per_gb_month))


def used_by(s: Session, volume: Volume, live: list[ClusterRecord] | None = None, but: str = "") -> str:
    """The live cluster (other than `but`) the volume is given to: a cluster whose spec names it
    (`up --volume`), or whose instance the provider says it is attached to; else "instance ID"
    where no cluster here has that instance; "" when free."""
    clusters = [c for c in (s.ledger.clusters(include_down=False) if live is None else live) if c.name != but]
    for c in clusters:
        if c.spec.volume is not None and c.provider == volume.provider and c.spec.volume.id == volume.id:
            return c.name
    if volume.attached_to:
        for c in clusters:
            if any(i.id == volume.attached_to for i in s.ledger.instances(c.id)):
                return c.name
        mine = s.ledger.live_cluster(but) if but else None
        if mine is None or not any(i.id == volume.attached_to for i in s.ledger.instances(mine.id)):
            return f"instance {volume.attached_to}"  # a space: no cluster name has one
    return ""


def _store(s: Session, provider: str) -> VolumeStore:
    """The volume store of a provider, placed by the current settings (aws: region, profile);
    settings that could not launch a cluster there (ssh without hosts) still reach its volumes."""
    settings = s.settings().settings.model_copy(update={"provider": provider})
    try:
        spec = provider_class(provider).spec_from_settings(settings)
    except ConfigError:
        spec = parse_spec({"name": settings.cluster, "provider": provider})
    return s.provider(spec).volume_store()


def _named(s: Session, name: str) -> Volume:
    check_name(name)
    volume = s.ledger.volume(name)
    if volume is None:
        raise NotFoundError(f"no volume named {name!r}",
                            "`gpuctl volume ls` lists yours; `gpuctl volume create NAME --size GB` makes one.")
    return volume


def _fresh(s: Session, store: VolumeStore, volume: Volume) -> Volume:
    """The volume as its provider sees it now (recorded); NotFoundError when it is gone."""
    now = store.describe(volume)
    if now is None:
        s.ledger.volume_removed(volume.provider, volume.id)
        raise NotFoundError(f"volume {volume.name!r} ({volume.id}) no longer exists",
                            "It was deleted outside gpuctl; `gpuctl volume create` makes a new one.")
    if now != volume:
        s.ledger.put_volume(now)
    return now


# --- create ---------------------------------------------------------------------------------------

def plan(s: Session, name: str, size_gb: int, zone: str | None = None) -> VolumePlan:
    """Every check `volume create` makes before it creates anything: the name, the size, the
    name free, where it goes."""
    check_name(name)
    check_size(size_gb)
    if s.ledger.volume(name) is not None:
        raise ConflictError(f"a volume named {name!r} exists already",
                            "Pick another name; `gpuctl volume ls` lists yours.")
    provider = s.settings().settings.provider
    store = _store(s, provider)
    where = store.where(zone)
    if store.lists_its_own and any(v.name == name for v in store.volumes()):
        raise ConflictError(f"a volume named {name!r} exists already in {provider}",
                            "Pick another name; `gpuctl volume ls` lists yours (and records what it finds).")
    return VolumePlan(name=name, provider=provider, size_gb=size_gb, where=where,
                      monthly_usd=size_gb * store.usd_per_gb_month)


def create(s: Session, asked: VolumePlan, progress: Progress = quiet) -> VolumeInfo:
    """Make the volume (in the ledger from the moment it has an id)."""
    store = _store(s, asked.provider)
    volume = store.create(asked.name, asked.size_gb, asked.where, s.ledger.put_volume)
    s.ledger.put_volume(volume)
    s.ledger.event("volume-create", f"{volume.name}: {volume.id}, {volume.size_gb} GB"
                                    f"{f' in {volume.zone}' if volume.zone else ''}")
    progress(f"volume {volume.name}: {volume.id}, {volume.size_gb} GB")
    return info(s, volume)


# --- ls -------------------------------------------------------------------------------------------

def ls(s: Session) -> VolumeList:
    """This install's volumes, each with the cluster it is given to and its $/month. The provider
    of the settings is asked afresh where its own word is the truth (aws: what EC2 lists by tag,
    its attachments), and the ledger learns of any it lacked or that went."""
    notes: list[str] = []
    provider = s.settings().settings.provider
    try:
        store = _store(s, provider)
        if store.lists_its_own:
            _reconcile(s, store)
    except GpuctlError as exc:  # offline, no credentials: what the ledger knows is still worth listing
        notes.append(f"{provider} not asked: {exc.message}")
    live = s.ledger.clusters(include_down=False)
    return VolumeList(volumes=tuple(info(s, v, live=live) for v, _ in s.ledger.volumes()), notes=tuple(notes))


def _reconcile(s: Session, store: VolumeStore) -> None:
    found = store.volumes()
    for v in found:
        s.ledger.put_volume(v)
    there = {v.id for v in found}
    places = {(v.provider, v.region) for v in found} | {(store.provider, store.region)}
    for v, _ in s.ledger.volumes():
        if (v.provider, v.region) in places and v.id not in there:
            s.ledger.volume_removed(v.provider, v.id)


# --- rm -------------------------------------------------------------------------------------------

def removable(s: Session, name: str) -> Volume:
    """The volume `volume rm NAME` would delete, if it may: it exists and nothing uses it."""
    volume = _named(s, name)
    store = _store(s, volume.provider)
    volume = _fresh(s, store, volume)
    user = used_by(s, volume)
    if user:
        raise ConflictError(f"volume {name!r} is attached to {_who(user)}; it is not deleted while in use",
                            f"Detach it from that {user} (EC2 console), then `gpuctl volume rm {name}`."
                            if _foreign(user) else
                            f"`gpuctl down {user}` first (the volume stays), then `gpuctl volume rm {name}`.")
    return volume


def _foreign(user: str) -> bool:
    return user.startswith("instance ")


def _who(user: str) -> str:
    return f"{user}, which no cluster of this gpuctl home has" if _foreign(user) else f"cluster {user!r}"


def remove(s: Session, volume: Volume, progress: Progress = quiet) -> VolumeInfo:
    """Delete a volume `removable` let through, and what it holds."""
    _store(s, volume.provider).remove(volume, progress)
    s.ledger.volume_removed(volume.provider, volume.id)
    s.ledger.event("volume-rm", f"{volume.name}: {volume.id}, {volume.size_gb} GB")
    return info(s, volume, removed_at=time.time())


# --- up --volume ----------------------------------------------------------------------------------

def for_up(s: Session, spec: ClusterSpec, name: str) -> ClusterSpec:
    """The spec `up --volume NAME` launches: the volume recorded in it (aws: the cluster goes to
    its zone). Refused, before anything is launched: no such volume, one of another provider, one
    given to another live cluster, one the cluster cannot reach (aws: another --zone or region)."""
    volume = _named(s, name)
    if volume.provider != spec.provider:
        raise ConfigError(f"volume {name!r} is a {volume.provider} volume; this cluster is {spec.provider}",
                          f"Use it with --provider {volume.provider}, or create a {spec.provider} volume "
                          f"(`gpuctl volume create NAME --size GB --provider {spec.provider}`).")
    store = s.provider(spec).volume_store()
    volume = _fresh(s, store, volume)
    user = used_by(s, volume, but=spec.name)
    if user:
        raise ConflictError(f"volume {name!r} is attached to {_who(user)}",
                            f"Detach it from that {user} first (EC2 console)." if _foreign(user) else
                            f"`gpuctl down {user}` first (the volume stays), or use another volume.")
    return spec.model_copy(update={"volume": store.use(volume)})


# --- what they cost -------------------------------------------------------------------------------

def storage(s: Session, now: float | None = None) -> VolumeStorage:
    """Every volume the ledger knows, removed ones too, with its dollars to date (no cloud call)."""
    live = s.ledger.clusters(include_down=False)
    rows = tuple(info(s, v, removed, now, live) for v, removed in s.ledger.volumes(include_removed=True))
    kept = [r for r in rows if r.removed_at is None]
    return VolumeStorage(volumes=rows, gb=float(sum(r.size_gb for r in kept)),
                         usd_per_month=sum(r.monthly_usd for r in kept), accrued_usd=sum(r.accrued_usd for r in rows))


def kept(s: Session) -> tuple[VolumeInfo, ...]:
    """The volumes that exist (what `down --all` leaves, and says it leaves)."""
    return tuple(v for v in storage(s).volumes if v.removed_at is None)
