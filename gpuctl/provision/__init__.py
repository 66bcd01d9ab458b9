"""The provider contract, and a lazy registry of its implementations.

A provider turns a ClusterSpec into instances, hands out a Host for each, and releases them.
Everything that differs between clouds and owned machines is declared here and answered inside
`provision/<provider>/`; the use cases above never ask which provider they hold. The registry
(config/providers.py) maps names to import paths: a provider's module is imported only when a
cluster needs its class.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NoReturn, Protocol, cast

from gpuctl.config.providers import PROVIDERS as PROVIDERS, unknown_provider  # PROVIDERS: re-exported
from gpuctl.errors import ConfigError, GpuctlError
from gpuctl.model.images import BakeContents, BakedImage, StoreTarget
from gpuctl.model.specs import Capabilities, RemoteSpec, RunFiles
from gpuctl.payloads.gpuctl_setup import matches

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable

    from gpuctl.config.settings import Settings
    from gpuctl.model.data import S3Listing, S3Source
    from gpuctl.model.records import InstanceRecord, PriceQuote, Resource
    from gpuctl.model.specs import ClusterSpec
    from gpuctl.model.volumes import Volume, VolumeUse
    from gpuctl.remote.host import Host



class Provider(Protocol):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]  # what the use cases decide by (model/specs.py)

    def __init__(self, home: "Path", spec: "ClusterSpec") -> None: ...

    @classmethod
    def spec_from_settings(cls, settings: "Settings", usd_per_hour: float | None = None) -> "ClusterSpec":
        """What `up` asks for, from the settings (the only place a provider reads settings)."""

    def check(self) -> None:
        """Raise what would stop a launch before it creates anything (credentials, region), so that
        `up` records no cluster for it."""

    def price_quote(self) -> "PriceQuote | None":
        """The $/h the launch is about to be billed (None: nothing is billed), asked before anything
        is created; a price cap no offer meets is refused here (ConfigError)."""

    def launch(self, progress: "Callable[[str], None]", wait_ssh: bool = True,
               launched: "Callable[[InstanceRecord], None]" = ...) -> "list[InstanceRecord]":
        """Create the spec's instances, or find and reuse them, and return them. `launched` hears
        each instance it creates as soon as the provider gave its id (launch time, type, market,
        price), again when its record changes before the launch returns (running, addresses; ended
        where the launch gave it up), in the calling thread: what bills is in the ledger whatever
        happens next (a failed SSH wait, Ctrl-C, a crash). Reused instances are not told."""

    def remember(self, instances: "list[InstanceRecord]") -> None:
        """The cluster's instances as `up` settled them after `launch` (a node given its own work
        dir where nodes share one): a provider that keeps its own view of them records them so."""

    def host(self, instance: "InstanceRecord", connect_timeout_s: float | None = None,
             progress: "Callable[[str], None] | None" = None) -> "Host":
        """A Host to run commands and move files on this instance (connect within the timeout,
        telling `progress` while a slow connection waits)."""

    def reconcile(self, instances: "list[InstanceRecord]") -> "list[InstanceRecord]":
        """The instances as the provider sees them now (state, when and why they ended)."""

    def discover(self, cluster: str | None = None, region: str | None = None) -> "list[Resource]":
        """Everything this provider created for gpuctl (for one cluster, or all), found afresh."""

    def release(self, resources: "list[Resource]", progress: "Callable[[str], None]",
                unreachable: "frozenset[str]" = frozenset()) -> None:
        """Delete the resources; already-gone ones are fine. `unreachable`: ids of instances that
        did not answer in this command, not waited for again (what may run on them is said)."""

    def set_hard_cap(self, host: "Host", hours: float) -> bool:
        """Move the boot-time hard cap; False where the instance has none to move."""

    def checkpoint_store(self) -> "CheckpointStore | None":
        """Where this cluster's runs keep checkpoints and reports so that they outlive its
        instances (aws: an S3 bucket); None where they stay on the host."""

    def was_interrupted(self, instance: "InstanceRecord") -> bool:
        """Whether the provider took this ended instance away (a spot interruption, or it vanished)
        rather than the user or a guard ending it: what recovery answers by replacing it."""

    def end_interrupted(self, instances: "list[InstanceRecord]", progress: "Callable[[str], None]",
                        taken: "set[str] | None" = None) -> "list[InstanceRecord]":
        """End what is left of a cluster's instances before a replacement is launched, the cheapest
        way the provider allows; the instances as they are then (ended). `taken`: the ids the
        provider is taking away (None: all of them); the others are ended at once."""

    def interruption_notice(self) -> "dict[str, Any] | None":
        """What the watchdog polls for a notice that the instance is about to be taken away
        ({"endpoint": URL, "interval_s": 5} for a spot instance's IMDSv2); None where none comes."""

    def kept_run(self, run_id: str) -> "tuple[Host, str] | None":
        """Where a run's directory (outputs, checkpoints, log, reports) is kept once its cluster was
        released: (a Host, the run's directory there) for `pull`, `train --resume --cluster OTHER`
        and `runs rm`; None where nothing of it is kept by gpuctl (local keeps each run's under
        the gpuctl home; aws keeps checkpoints in its store, see checkpoint_store)."""

    def run_files(self) -> RunFiles:
        """What becomes of the runs' files when the cluster is released (`down` says it; where they
        exist only on the instances, it lists those runs and offers `down --pull`)."""

    def data_region(self) -> str | None:
        """The AWS region its machines fetch a data set in (what S3 bills the transfer by); None:
        they are outside AWS."""

    def data_access(self, listing: "S3Listing", progress: "Callable[[str], None]") -> "dict[str, Any] | None":
        """How its machines read an S3 data set themselves: None, with links made here (the
        user's credentials); or how an instance signs its own with its role, which may read
        exactly the listing's prefix from now on (aws with an instance profile):
        {imds, bucket, prefix, region, endpoint, virtual}."""

    def image_store(self) -> "ImageStore":
        """Where `gpuctl image` keeps machine images with TensorFlow baked in; ConfigError
        (`no_image_store`) for a provider that has none."""

    def volume_store(self) -> "VolumeStore":
        """Where `gpuctl volume` makes named volumes that outlive clusters (aws: EBS; local and
        ssh: a directory on the host)."""

    def snapshot_store(self) -> "SnapshotStore":
        """Where `gpuctl data push` keeps named data snapshots (aws: the gpuctl bucket of the
        region, under data/); ConfigError (`no_snapshot_store`) for a provider that has none."""

    def mount_volume(self, host: "Host") -> tuple[str, str]:
        """Make the spec's volume usable on the chief's host (aws: find the attached device,
        format it if it has nothing on it, mount it): the path its jobs find it at, and what was
        done (one clean line: "formatted ... mounted at ...", "mounted ...", "already ...")."""


class CheckpointStore(Protocol):
    def target(self, cluster: str) -> StoreTarget:
        """The cluster's place in the store (made on first use)."""

    def files(self, cluster: str, run_id: str) -> "list[tuple[str, int]]":
        """(path under the run's prefix, bytes) of each file the run keeps there."""

    def copy(self, from_cluster: str, to_cluster: str, run_id: str) -> int:
        """Copy a run's files to another cluster's prefix (a resume elsewhere); how many."""

    def remove(self, cluster: str, run_id: str) -> int:
        """Delete a run's files; how many."""

    def download(self, cluster: str, run_id: str, dest: "Path", leave_out: "tuple[str, ...]" = ()
                 ) -> "tuple[int, tuple[str, ...]]":
        """A run's files into `dest` but for the top-level names in `leave_out` (`pull` after
        `down`): (files written, "key: why" of each one skipped)."""

    def usage(self) -> "dict[tuple[str, str], int]":
        """Bytes kept per (cluster, run id), for `cost`."""


# A TensorFlow version as gpuctl takes it (settings' train.tensorflow): also what an instance's
# report must look like before it names an image or a tag.
TF_VERSION = re.compile(r"[0-9]+\.[0-9]+(\.[0-9]+)?")


class ImageStore(Protocol):
    region: str  # where its images are (an AWS region)

    def images(self) -> "list[BakedImage]":
        """This install's baked images (in the provider's region) in every state, newest first."""

    def bake_base(self, progress: "Callable[[str], None]") -> str:
        """The id of the image a bake starts from (never a baked one); refuses, before anything is
        created, a machine type that image cannot run."""

    def capture(self, instance: "InstanceRecord", contents: BakeContents, progress: "Callable[[str], None]",
                created: "Callable[[BakedImage], None]") -> BakedImage:
        """Make an image of the instance, tagged (with its storage) with what it carries; `created`
        hears of it as soon as it exists, before the long wait for it to be available."""

    def remove(self, image_id: str, progress: "Callable[[str], None]") -> BakedImage:
        """Delete one of this install's images and its storage; refuses any other image."""


class VolumeStore(Protocol):
    provider: str
    region: str  # aws: where it lists and creates; "" elsewhere
    usd_per_gb_month: float  # what a GB of its volumes costs a month (0: your own disk)
    # True: the provider's own view (EC2's tags) is the truth and the ledger follows it; False:
    # the ledger's record is the volume (a directory on a machine of the user's).
    lists_its_own: bool

    def where(self, zone: str | None) -> str:
        """Where a new volume goes (aws: the zone, --zone or the one `up` would pick; ssh: the
        host; local: ""), checked before anything is created."""

    def create(self, name: str, size_gb: int, where: str, created: "Callable[[Volume], None]") -> "Volume":
        """Make the volume, tagged; `created` hears of it as soon as it has an id."""

    def volumes(self) -> "list[Volume]":
        """This install's volumes as the provider sees them now (aws: with their attachments)."""

    def describe(self, volume: "Volume") -> "Volume | None":
        """The volume as the provider sees it now; None: it is gone."""

    def use(self, volume: "Volume") -> "VolumeUse":
        """What the cluster about to launch (the store's spec) records of the volume; ConfigError
        where it cannot use it (aws: a --zone other than the volume's; ssh: another first host)."""

    def remove(self, volume: "Volume", progress: "Callable[[str], None]") -> None:
        """Delete it (and what it holds); refuses one attached to an instance."""


class SnapshotStore(Protocol):
    @property
    def region(self) -> str:
        """The region of the bucket."""

    @property
    def bucket(self) -> str:
        """The bucket the snapshots are in (gpuctl's of this account, region and owner)."""

    def push(self, name: str, directory: "Path", manifest: "Path", progress: "Callable[[str], None]",
             starting: "Callable[[], None]") -> "dict[str, Any]":
        """Upload what changed in `directory` to the snapshot `name` (the bucket made first if need
        be), and remove the objects whose file is gone; `manifest`: where what was uploaded is
        remembered (size, mtime, ETag); `starting` hears, once, that the first byte is about to go.
        The summary: files, total_bytes, uploaded, bytes, deleted."""

    def remove(self, name: str) -> int:
        """Delete every object of the snapshot; how many."""


def no_snapshot_store(provider: str) -> ConfigError:
    return ConfigError(f"the {provider} provider has no bucket for data snapshots",
                       "`gpuctl data push` uploads to your gpuctl bucket in S3 (the aws provider's settings).")


def tf_matches(asked: str, have: str | None) -> bool:
    """Whether TensorFlow `have` serves a request for `asked`: '2.21' is any 2.21.x (and 2.21
    itself); '2.21.0' is exactly that. The setup payload's rule, the one the instance applies."""
    return matches(have, asked)


def no_image_store(provider: str) -> ConfigError:
    return ConfigError(f"`gpuctl image` is for the aws provider; the {provider} provider has no machine images",
                       "Run it with --provider aws (or `provider = \"aws\"` in the settings).")


class ProviderBase:
    """The class-level half of the Provider contract, declared once for every provider."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]


class MachinesThatStay(ProviderBase):
    """What local and ssh providers answer alike: machines that are there before gpuctl and after
    it, which nobody takes away with a warning, and which have no machine images."""

    def image_store(self) -> NoReturn:
        raise no_image_store(self.name)

    def snapshot_store(self) -> NoReturn:
        raise no_snapshot_store(self.name)

    def remember(self, instances: "list[InstanceRecord]") -> None:
        pass  # the ledger's record is the only one (ssh keeps its own: it overrides this)

    def data_region(self) -> None:
        return None  # hosts of one's own: outside AWS, as far as gpuctl knows

    def data_access(self, listing: "S3Listing", progress: "Callable[[str], None]") -> None:
        return None  # no instance role: links made on this machine

    def checkpoint_store(self) -> None:
        return None  # checkpoints stay on the host, which outlives the cluster (`gpuctl pull`)

    def was_interrupted(self, instance: "InstanceRecord") -> bool:
        return False

    def kept_run(self, run_id: str) -> "tuple[Host, str] | None":
        return None

    def interruption_notice(self) -> None:
        return None

    def end_interrupted(self, instances: "list[InstanceRecord]", progress: "Callable[[str], None]",
                        taken: "set[str] | None" = None) -> "list[InstanceRecord]":
        return instances  # never interrupted: recovery does not run here


def ignore_launched(_: "InstanceRecord") -> None:
    """The default `launched` of Provider.launch: a caller that records nothing as it goes."""


def provider_class(name: str) -> type[Provider]:
    """The class registered under `name` (imports its module only now)."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ConfigError(
            unknown_provider(name), f"Known providers: {', '.join(sorted(PROVIDERS))}."
        ) from None
    module, _, attr = target.partition(":")
    # cast: the registry (config/providers.py) names only classes that implement Provider.
    return cast("type[Provider]", getattr(importlib.import_module(module), attr))


def foreign_error(exc: BaseException) -> GpuctlError | None:
    """An exception a provider's own library raised (botocore's, say) that no call site turned
    into a gpuctl error: as that provider says it (AWS: a CloudError, exit 9), never an internal
    error. Only providers this command loaded are asked."""
    for name, target in PROVIDERS.items():
        if target.partition(":")[0] in sys.modules:
            known = getattr(provider_class(name), "foreign_error", None)
            said: GpuctlError | None = known(exc) if known is not None else None
            if said is not None:
                return said
    return None


class DataSets(Protocol):
    """Data sets in object storage, read from this machine with the user's own credentials
    (whatever the cluster's provider: a lab box fetches from S3 too)."""

    def listing(self, source: "S3Source") -> "S3Listing":
        """The objects below the source's prefix; DataError: no such bucket, denied, empty."""

    def signer(self, listing: "S3Listing", expires_s: int) -> "tuple[dict[str, str], Callable[[str], str]]":
        """Presigned GET links for the paths below the prefix, valid `expires_s` seconds, as a
        fetch plan carries them: the template they share, and a function giving one path's
        signature (gpuctl_s3sign.template_link makes the link of the two)."""


DATA_SETS = "gpuctl.provision.aws.datasets:S3DataSets"


def data_sets(profile: str = "", region: str = "") -> DataSets:
    """The S3 data sets' reader (imports botocore only now, for the credentials): `profile` and `region` as the settings
    say (`aws.profile`; the cluster's region, where the bucket's own cannot be learned)."""
    module, _, attr = DATA_SETS.partition(":")
    return cast(DataSets, getattr(importlib.import_module(module), attr)(profile, region))


def get_provider(home: "Path", spec: "ClusterSpec") -> Provider:
    """The provider for a cluster spec."""
    return provider_class(spec.provider)(home, spec)


def spec_from_settings(settings: "Settings", usd_per_hour: float | None = None) -> "ClusterSpec":
    """The spec `up` would launch with these settings."""
    return provider_class(settings.provider).spec_from_settings(settings, usd_per_hour)


def refuse_placement(settings: "Settings") -> None:
    """A placement group is EC2's: machines that are already somewhere cannot be placed."""
    if settings.aws.placement:
        raise ConfigError(f"--placement {settings.aws.placement} is for aws clusters",
                          "Leave it out here (or unset aws.placement): local and ssh machines are where they are.")


def remote_spec(settings: "Settings") -> RemoteSpec:
    """The `remote.*` settings as the spec carries them."""
    return RemoteSpec(**settings.remote.model_dump(include=set(RemoteSpec.model_fields)))
