"""A cluster's spec: everything `up` fixed for it, so that later commands (status, logs, down)
work from what the ledger recorded, whatever the settings files say by then.

`ClusterSpec` is what every provider's cluster has; each provider's spec adds what only it has
(`AwsSpec`, `SshSpec`, `LocalSpec`) and answers what the use cases ask of any spec (may its
machines be taken away, what must match for `up` to reuse it, where its resources are looked
for, its checkpoint store) so that ops/ never reads a provider's own fields. The ledger keeps a
spec as JSON tagged by `provider` (`AnySpec` reads it back as the right class).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter


class Frozen(BaseModel):
    # No inf or nan crosses a layer: JSON has no spelling for them, and the ledger must read back what it wrote.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)


class Capabilities(Frozen):
    """What a provider does that the use cases decide by, stated once by each provider (its class's
    `capabilities`); the words a user reads about them are cli/render's."""

    # `up` on a live cluster finds its instances (by tag) and reuses them; False: a conflict.
    reuses_live_clusters: bool = False
    # `up` arms the watchdog as soon as SSH works (it pays by the hour from then on); False: the
    # first `train` arms it.
    arms_guard_at_up: bool = False
    # What the watchdog does when a guard fires, unless `guards.on_fire` says otherwise.
    default_on_fire: Literal["poweroff", "stop-jobs"] = "stop-jobs"
    # The instance powers itself off `max_hours` after boot (armed by the provider at launch).
    boot_hard_cap: bool = False
    # It launches machines of the type asked for (`aws.instance_type`, `plan --type`); False: its
    # machines are what they are.
    picks_instance_types: bool = False


class RunFiles(Frozen):
    """What becomes of a cluster's runs' files when it is released, as its provider keeps them."""

    # here: moved under the gpuctl home (`where`); on_hosts: left on the user's machines; in_store:
    # in the checkpoint store (S3); on_instance: on the instance's disk only, gone with it.
    kept: Literal["here", "on_hosts", "in_store", "on_instance"]
    where: Optional[str] = None


class RemoteSpec(Frozen):
    """How gpuctl works on a remote host (from the `remote.*` settings at `up`)."""

    python: str = ""
    workdir: str = "~/gpuctl"
    connect_timeout_s: float = 120.0
    command_timeout_s: float = 30.0
    ssh_config: str = ""
    wheelhouse: str = ""


class VolumeUse(Frozen):
    """What a cluster's spec records of the volume `up --volume` gave it."""

    name: str
    id: str  # aws: vol-...; local and ssh: the directory
    path: str  # where the chief's jobs find it
    zone: str = ""
    host: str = ""


class ClusterSpec(Frozen):
    """What every cluster has; a provider gpuctl does not know (a test's) gets this one."""

    name: str
    provider: str
    instance_type: str = "local"
    nodes: int = 1
    usd_per_hour: float = 0.0
    # Random per `up` of this cluster; seeds RunInstances client tokens so a retried `up`
    # cannot start a second instance for the same request.
    launch_token: str = ""
    # The TensorFlow the cluster is set up with (train.tensorflow at `up`).
    tensorflow: str = ""
    max_hours: float = 8.0  # the hard cap
    # "": the user's cluster. Else the use case that launched it for itself and releases it ("plan",
    # "bake"): never the cluster a command that names none picks as "the only one up".
    launched_for: str = ""
    # `up --volume NAME`: the volume attached to (aws) or found on (local, ssh) the chief.
    volume: Optional[VolumeUse] = None
    remote: RemoteSpec = RemoteSpec()
    # How its instances are billed: "per-second" (EC2: 60 s minimum, piecewise spot, EBS
    # storage) or "hourly-rate" (seconds x the set rate, for machines nobody rents by the second).
    billing: Literal["per-second", "hourly-rate"] = "hourly-rate"
    # 2: everything above is recorded at `up`. 1: recorded by gpuctl 0.1, which kept only what the
    # user asked for and read the rest from the settings of each command (the ledger's upgrade marks it).
    version: int = 2

    # What decides which machines a cluster gets: `up` of a live cluster asking other values of
    # these is refused; the rest (timeouts, remote.*) may differ on reuse.
    launch_fields: ClassVar[frozenset[str]] = frozenset({"provider", "instance_type", "nodes", "tensorflow"})
    # Who may reach the cluster: always as the latest `up` asks, never as an earlier (perhaps killed) one did.
    access_fields: ClassVar[frozenset[str]] = frozenset()

    @property
    def interruptible(self) -> bool:
        """Its machines may be taken away (spot): runs on it are recovered by default."""
        return False

    @property
    def scope(self) -> Optional[str]:
        """Where its provider looks for what it made of it (aws: the region); None: the default."""
        return None

    @property
    def store_place(self) -> str:
        """The cluster's place in a checkpoint store."""
        return self.name

    @property
    def store_key(self) -> Optional[tuple[str, ...]]:
        """Which checkpoint store its runs may have used (one per provider, region and profile);
        None: none."""
        return None

    @property
    def checkpoint_hint(self) -> str:
        """What to set so that a run's checkpoint outlives the machine, when it did not."""
        return ""

    @property
    def metadata_endpoint(self) -> Optional[str]:
        """The instance metadata service its jobs take credentials from (the S3 store's)."""
        return None

    @property
    def billed_storage_gb(self) -> int:
        """Disk billed apart from the machine (EBS), over the instance's whole life."""
        return 0

    def on_demand_fallback(self) -> ClusterSpec:
        """This spec, replacing a machine on-demand when spot has none (where that means anything)."""
        return self


class LocalSpec(ClusterSpec):
    """This machine playing the instance."""

    provider: Literal["local"] = "local"


class SshSpec(ClusterSpec):
    """Hosts the user has."""

    provider: Literal["ssh"] = "ssh"
    hosts: tuple[str, ...] = ()  # user@host[:port] (or ssh config alias) of each machine
    identity: Optional[str] = None  # private key path

    launch_fields: ClassVar[frozenset[str]] = ClusterSpec.launch_fields | {"hosts"}


class AwsSpec(ClusterSpec):
    """EC2 instances."""

    provider: Literal["aws"] = "aws"
    market: Literal["spot", "on-demand"] = "on-demand"
    max_price: Optional[float] = None
    image: Optional[str] = None
    region: Optional[str] = None
    zones: tuple[str, ...] = ()
    disk_gb: int = 0
    placement: str = ""  # "cluster" = the nodes share a cluster placement group
    profile: Optional[str] = None  # the profile that launched it
    fallback_on_demand: bool = False
    image_pattern: str = ""
    base_os: str = "ubuntu-22.04"  # the base image's OS, that gpuctl installs TF on when no image carries it
    ssh_cidr: str = ""
    ssh_user: str = "ubuntu"  # the image's login user
    wait_timeout_s: float = 900.0
    # The limits the watchdog started at boot has until `train` re-arms it (userdata.py).
    boot_guard: dict[str, Any] = Field(default_factory=dict)
    # Where runs keep checkpoints ("s3": a bucket that outlives the instance; "instance"), the
    # bucket's expiry, and the metadata service the watchdog asks for spot notices.
    checkpoints: str = ""
    checkpoint_expiry_days: int = 30
    checkpoint_versions_days: int = 0
    imds_endpoint: str = ""
    imds_hop_limit: int = 1  # 2 where containers on the instance may reach IMDS (aws.imds_for_containers)
    imds_poll_s: float = 5.0
    # This cluster's own place in the checkpoint store (random per `up`), so that a later cluster
    # of the same name never reads or deletes this one's checkpoints; "" for a cluster made before
    # it existed, whose place is its name.
    store_id: str = ""

    launch_fields: ClassVar[frozenset[str]] = ClusterSpec.launch_fields | {
        "market", "max_price", "image", "region", "disk_gb", "base_os"}  # the last two choose the image
    access_fields: ClassVar[frozenset[str]] = frozenset({"ssh_cidr"})

    @property
    def interruptible(self) -> bool:
        return self.market == "spot"

    @property
    def scope(self) -> Optional[str]:
        return self.region

    @property
    def store_place(self) -> str:
        """`name.id` (cluster names hold no dot)."""
        return f"{self.name}.{self.store_id}" if self.store_id else self.name

    @property
    def store_key(self) -> Optional[tuple[str, ...]]:
        return (self.provider, self.region or "", self.profile or "") if self.checkpoints else None

    @property
    def checkpoint_hint(self) -> str:
        if self.checkpoints != "instance":
            return ""
        return " (keep the next run's checkpoints off the instance: aws.checkpoints = \"s3\")"

    @property
    def metadata_endpoint(self) -> Optional[str]:
        return self.imds_endpoint or None

    @property
    def billed_storage_gb(self) -> int:
        return self.disk_gb

    def on_demand_fallback(self) -> ClusterSpec:
        return self if self.fallback_on_demand else self.model_copy(update={"fallback_on_demand": True})


SPEC_CLASSES: dict[str, type[ClusterSpec]] = {"aws": AwsSpec, "ssh": SshSpec, "local": LocalSpec}


def _kind(value: Any) -> str:
    provider = value.get("provider") if isinstance(value, dict) else getattr(value, "provider", None)
    return provider if provider in SPEC_CLASSES else "other"


AnySpec = Annotated[
    Union[Annotated[AwsSpec, Tag("aws")], Annotated[SshSpec, Tag("ssh")], Annotated[LocalSpec, Tag("local")],
          Annotated[ClusterSpec, Tag("other")]],
    Discriminator(_kind),
]


@functools.cache
def _adapter() -> TypeAdapter[ClusterSpec]:
    # Built on first use, as the models are (defer_build): a command that reads no spec skips it.
    return TypeAdapter(AnySpec)


def parse_spec(data: dict[str, Any] | str) -> ClusterSpec:
    """A spec from its JSON (or dict), as the class its `provider` names."""
    return _adapter().validate_json(data) if isinstance(data, str) else _adapter().validate_python(data)


def spec_fields(provider: str) -> set[str]:
    """The fields a spec of this provider has (the ledger's upgrade keeps only these)."""
    return set(SPEC_CLASSES.get(provider, ClusterSpec).model_fields)
