"""Machine images with TensorFlow baked in: `gpuctl image bake`, `image ls`, `image rm`, and what
their storage costs.

A bake is an ordinary cluster (`bake-tf2-21-<hex>` for TF 2.21, launched through `clusters.up` from the
provider's base image), so it is tagged, guarded, in the ledger and in `cost`, and a bake killed
at any moment leaves nothing `status --all` / `down --all` cannot find. The image itself carries
gpuctl's tags, so `image ls` finds it too. Which provider can bake is the provider's answer
(`Provider.image_store`); nothing here asks which provider it holds.
"""

from __future__ import annotations

import secrets
import time
from typing import Optional

from pydantic import BaseModel, ConfigDict

from gpuctl.errors import RemoteError
from gpuctl.model import billing
from gpuctl.model.images import BakeContents, BakedImage
from gpuctl.model.records import ClusterRecord, InstanceRecord
from gpuctl.model.requests import UpRequest
from gpuctl.ops.session import Progress, Session, quiet
from gpuctl.provision import TF_VERSION, ImageStore, tf_matches

# Snapshot storage, standard tier: the us-east-1 list price; reports name it with its date.
SNAPSHOT_USD_PER_GB_MONTH = 0.05
SNAPSHOT_PRICE = f"${SNAPSHOT_USD_PER_GB_MONTH:.2f}/GB-month (EBS snapshot list price, us-east-1, 2026-11)"
BAKE_MAX_HOURS = 2.0  # the hard cap of a bake's instance (at most; a lower guards.max_hours stays)


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)


class ImageInfo(BakedImage):
    """A baked image with what its storage costs."""

    usd_per_month: float  # while it exists; 0 once removed
    removed_at: Optional[float] = None
    accrued_usd: float = 0.0  # storage since it was made (until removed)


class ImageList(_Result):
    region: str
    images: tuple[ImageInfo, ...]
    price: str = SNAPSHOT_PRICE


class BakeResult(_Result):
    image: ImageInfo
    cluster: str  # the bake's cluster (released)
    base_image: str
    seconds: float
    price: str = SNAPSHOT_PRICE


class ImageStorage(_Result):
    """`cost`: what the baked images cost in snapshot storage, from the ledger alone."""

    images: tuple[ImageInfo, ...] = ()
    gb: float = 0.0  # of the images that exist
    usd_per_month: float = 0.0
    accrued_usd: float = 0.0  # every image's, removed ones included
    price: str = SNAPSHOT_PRICE


def info(image: BakedImage, removed_at: float | None = None, now: float | None = None) -> ImageInfo:
    end = removed_at or (time.time() if now is None else now)
    return ImageInfo(**{**image.model_dump(), "state": "removed" if removed_at else image.state}, removed_at=removed_at,
                     usd_per_month=0.0 if removed_at else image.size_gb * SNAPSHOT_USD_PER_GB_MONTH,
                     accrued_usd=billing.storage_cost(image.size_gb, image.created_at, end, SNAPSHOT_USD_PER_GB_MONTH))


def _store(s: Session) -> ImageStore:
    """The image store of the provider the settings name (ConfigError where it has none)."""
    from gpuctl.ops import release  # the release code (and the push code it imports) not for `cost`

    # release.searcher builds that provider from the settings, also where they could not
    # launch a cluster (an ssh provider without hosts), so its refusal is about images.
    return release.searcher(s, s.settings().settings.provider).image_store()


def ls(s: Session) -> ImageList:
    """This install's baked images as the provider lists them (the ledger learns of any it lacked,
    e.g. from a bake killed after the image was made, and of any removed elsewhere)."""
    store = _store(s)
    found = store.images()
    _reconcile(s, store.region, found)
    return ImageList(region=store.region, images=tuple(info(i) for i in found))


def _reconcile(s: Session, region: str, found: list[BakedImage]) -> None:
    known = {(i.region, i.id): removed for i, removed in s.ledger.images()}
    for image in found:
        s.ledger.put_image(image)  # new, or its state and size as they are now (a pending one is done)
    there = {i.id for i in found}
    for (where, image_id), removed in known.items():
        if where == region and removed is None and image_id not in there:
            s.ledger.image_removed(where, image_id)


def remove(s: Session, image_id: str, progress: Progress = quiet) -> ImageInfo:
    """Deregister one of this install's images and delete its snapshots (the store refuses any
    other image before it deletes anything)."""
    removed = _store(s).remove(image_id, progress)
    if not any(i.id == removed.id and i.region == removed.region for i, _ in s.ledger.images()):
        s.ledger.put_image(removed)
    s.ledger.image_removed(removed.region, removed.id)
    s.ledger.event("image-rm", f"{removed.id} ({removed.name}) and {len(removed.snapshots)} snapshot(s)")
    return info(removed, time.time())


def bake_question(s: Session) -> str:
    settings = s.settings().settings
    return (f"launch a {settings.aws.instance_type} ({settings.aws.market}) to bake TensorFlow "
            f"{settings.train.tensorflow} into an image (billed until the bake ends, which powers off after "
            f"{_max_hours(s):g} h at most; the image then costs {SNAPSHOT_PRICE})")


def _max_hours(s: Session) -> float:
    return min(s.settings().settings.guards.max_hours, BAKE_MAX_HOURS)


def bake(s: Session, progress: Progress = quiet, allow_cpu: bool = False,
         requirements: tuple[str, bytes] | None = None) -> BakeResult:
    """Launch from the base image, set TensorFlow up, prove it (preflight), install `requirements`
    (name, bytes) over it as a `train` with that file would (ops/packages.py: a train with the same
    file on an instance of the image then installs nothing), make the image (tagged with its
    snapshots; in the ledger as soon as it exists), release the cluster. The cluster is released
    however the bake ends."""
    from gpuctl.ops import clusters  # only for a bake: `cost` imports this module for storage()

    started = time.monotonic()
    store = _store(s)
    tf = s.settings().settings.train.tensorflow
    base = store.bake_base(progress)  # refuses a type the base image cannot run: nothing exists yet
    name = f"bake-tf{tf.replace('.', '-')}-{secrets.token_hex(2)}"  # cluster names have no dots
    bs = Session(s.home, {
        **s.flags, "cluster": name, "aws.image": base,
        # The setup step is what the image is made of: a remote.python of the user's would skip it.
        "remote.python": "",
        # A bake takes 20-40 minutes; one whose laptop died powers off after this, not after 8 h.
        "guards.max_hours": _max_hours(s),
    }, s.env)
    ok = False
    try:
        # Nobody's default: a `train` in another terminal must not land on the bake's instance.
        up = clusters.up(bs, UpRequest(make_default=False, launched_for="bake"), progress)
        image = _capture(bs, up.cluster, up.instances[0], tf, base, allow_cpu, requirements, progress)
        ok = True
    finally:
        _release(bs, name, ok, progress)
        bs.close()
    s.ledger.put_image(image)  # available now (recorded as pending when CreateImage answered)
    s.ledger.event("image-bake", f"{image.id}: TensorFlow {image.tensorflow} on {base} ({name})")
    return BakeResult(image=info(image), cluster=name, base_image=base, seconds=round(time.monotonic() - started, 1))


def _capture(bs: Session, cluster: ClusterRecord, instance: InstanceRecord, tf: str, base: str, allow_cpu: bool,
             requirements: tuple[str, bytes] | None, progress: Progress) -> BakedImage:
    from gpuctl.ops import packages, setup  # the setup step (and what it imports) only for a bake
    from gpuctl.remote import preflight

    # The preflight `up` started in the background is this very environment's, just made: its
    # answer (waited for on the host) is the proof.
    (env, *_) = setup.ensure(bs, cluster, progress, version=tf, check=True)
    report = env.report or {}
    refusal = preflight.verdict(report, allow_cpu)
    seen = str(report.get("tensorflow") or "")
    if refusal is None and not TF_VERSION.fullmatch(seen):  # the instance's word: it names the image
        refusal = f"it reports TensorFlow {seen[:40]!r}, which is not a version"
    elif refusal is None and not tf_matches(tf, seen):
        refusal = f"it imports TensorFlow {seen}, not {tf}"
    if refusal:
        raise RemoteError(f"not baking an image of {cluster.name}: {refusal}",
                          "A GPU type (--type g5.xlarge) gets TensorFlow with the GPU; --allow-cpu bakes a CPU-only "
                          "TensorFlow anyway.")
    # The variant is what the preflight saw: an --allow-cpu bake on a CPU type has tensorflow-cpu,
    # which `up` must never pick for a GPU type.
    baked_in = None
    if requirements is not None:  # where a train's install puts it: the image's disk keeps it
        name, data = requirements
        ((_, host),) = bs.hosts(cluster)
        packages.ensure(bs, host, env.python, name, data, cluster.spec.remote.wheelhouse, progress)
        baked_in = packages.label(name, data)
    contents = BakeContents(tensorflow=tf, installed=seen, variant="cuda" if report.get("tf_gpus") else "cpu",
                            base_image=base, packages=baked_in)
    bs.close()  # the instance reboots or stops next: end the SSH connections first
    return bs.provider(cluster.spec).image_store().capture(instance, contents, progress, created=bs.ledger.put_image)


def _release(bs: Session, name: str, ok: bool, progress: Progress) -> None:
    from gpuctl.ops import release

    release.release_own(bs, name, progress, f"{'' if ok else 'bake failed: '}releasing the bake's cluster {name} "
                                             "(instance, security group, key pair)")


def storage(s: Session, now: float | None = None) -> ImageStorage:
    """Snapshot storage of every image the ledger knows (no cloud call: `cost` answers offline)."""
    rows = tuple(info(i, removed, now) for i, removed in s.ledger.images())
    live = [r for r in rows if r.removed_at is None]
    return ImageStorage(images=rows, gb=sum(r.size_gb for r in live), usd_per_month=sum(r.usd_per_month for r in live),
                        accrued_usd=sum(r.accrued_usd for r in rows))
