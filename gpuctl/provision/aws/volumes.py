"""Volumes on EC2: EBS gp3, encrypted, tagged at creation (gpuctl:volume NAME, owner, created-by,
Name), in one zone; attached to a cluster's chief by `up --volume` and mounted there (mount.py).

A volume belongs to no cluster, so it carries `gpuctl:volume` where a cluster's resources carry
`gpuctl:cluster`: `down` (which finds what it releases by gpuctl:cluster) never sees it, and the
instance's termination only detaches it (AttachVolume leaves DeleteOnTermination false). The IAM
policy lets gpuctl attach, detach and delete only volumes that carry gpuctl:volume.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, Callable

from gpuctl import seams
from gpuctl.errors import CloudError, ConfigError, ConflictError
from gpuctl.model import billing, untrusted
from gpuctl.model.volumes import NAME, Volume, VolumeUse, mount_point
from gpuctl.provision.aws import access, catalog, mount
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.session import aws_errors, call, error_code, translate, wait_for
from gpuctl.remote.host import Host

TAG_VOLUME = "gpuctl:volume"
Progress = Callable[[str], None]
MOUNT_TIMEOUT_S = 300.0  # the device's wait, and mkfs.ext4 of a large volume (lazy init: seconds)


def tags(name: str, owner: str) -> list[dict[str, str]]:
    return [{"Key": TAG_VOLUME, "Value": name}, {"Key": access.TAG_OWNER, "Value": owner},
            {"Key": access.TAG_CREATED_BY, "Value": "gpuctl"}, {"Key": "Name", "Value": f"gpuctl-volume-{name}"}]


def _tag(item: dict[str, Any], key: str) -> str:
    return next((t["Value"] for t in item.get("Tags", []) if t["Key"] == key), "")


def _created(item: dict[str, Any]) -> float:
    at = item.get("CreateTime")
    return at.timestamp() if isinstance(at, dt.datetime) else time.time()


class AwsVolumes:
    provider = "aws"
    usd_per_gb_month = billing.GP3_USD_PER_GB_MONTH
    lists_its_own = True  # EC2's tags are the truth; the ledger follows them

    def __init__(self, ctx: AwsContext):
        self.ctx = ctx
        self.aws = ctx.aws(ctx.spec.region)
        self.region = self.aws.region

    def record(self, item: dict[str, Any], region: str | None = None) -> Volume:
        attached = [a.get("InstanceId", "") for a in item.get("Attachments", [])
                    if a.get("State") in ("attaching", "attached", "busy")]
        name = _tag(item, TAG_VOLUME)
        return Volume(name=name, provider="aws", id=item["VolumeId"], size_gb=int(item.get("Size") or 0),
                      created_at=_created(item), region=region or self.region, zone=item.get("AvailabilityZone", ""),
                      path=mount_point(name) if NAME.fullmatch(name) else "", usd_per_gb_month=self.usd_per_gb_month,
                      attached_to=attached[0] if attached else "", state=str(item.get("State") or ""))

    # --- the VolumeStore protocol --------------------------------------------------------------

    def where(self, zone: str | None) -> str:
        """--zone, or the zone `up` would pick for the settings' type (the cheapest spot price;
        on-demand: the first offering it): a volume where the GPU type is not offered is useless."""
        spec = self.ctx.spec
        zone = zone or (spec.zones[0] if spec.zones else "")
        offering = catalog.zones_offering(self.aws, spec.instance_type)
        if zone:
            if zone not in offering:
                raise ConfigError(f"zone {zone} does not offer {spec.instance_type} in {self.region}",
                                  f"Pick one that does: {', '.join(offering) or 'none here; try another --region'}.")
            return zone
        if not offering:
            raise ConfigError(f"{spec.instance_type} is not offered in any zone of {self.region}",
                              "Pick another --region, or --zone.")
        prices = catalog.spot_prices(self.aws, spec.instance_type) if spec.market == "spot" else {}
        return min(offering, key=lambda z: (prices.get(z, float("inf")), z))

    def create(self, name: str, size_gb: int, where: str, created: Callable[[Volume], None]) -> Volume:
        ec2 = self.aws.ec2()
        res = call(ec2.create_volume, AvailabilityZone=where, Size=size_gb, VolumeType="gp3", Encrypted=True,
                   TagSpecifications=[{"ResourceType": "volume", "Tags": tags(name, self.ctx.owner)}])
        created(self.record(res))  # known here before the wait: a create killed now still shows
        wait_for(ec2, "volume_available", self.ctx.spec.wait_timeout_s, what=f"volume {res['VolumeId']}",
                 hint=f"It may still become available: `gpuctl volume ls`; `gpuctl volume rm {name}` removes it.",
                 VolumeIds=[res["VolumeId"]])
        return self.describe_id(res["VolumeId"]) or self.record(res)

    def volumes(self) -> list[Volume]:
        filters = access.owner_filters(self.ctx.owner) + [{"Name": "tag-key", "Values": [TAG_VOLUME]}]
        found = call(self.aws.ec2().describe_volumes, Filters=filters).get("Volumes", [])
        # A name tag changed by hand into something gpuctl would not make is no volume of gpuctl's to list.
        return [self.record(v) for v in found if v.get("State") not in ("deleting", "deleted")
                and NAME.fullmatch(_tag(v, TAG_VOLUME))]

    def describe_id(self, volume_id: str, region: str | None = None) -> Volume | None:
        try:
            found = self.ctx.aws(region).ec2().describe_volumes(VolumeIds=[volume_id]).get("Volumes", [])
        except aws_errors() as exc:
            if error_code(exc) == "InvalidVolume.NotFound":
                return None
            raise translate(exc, "DescribeVolumes") from exc
        live = [v for v in found if v.get("State") not in ("deleting", "deleted")]
        return self.record(live[0], region) if live else None

    def describe(self, volume: Volume) -> Volume | None:
        return self.describe_id(volume.id, volume.region or None)

    def use(self, volume: Volume) -> VolumeUse:
        spec = self.ctx.spec
        if volume.region and volume.region != self.region:
            raise ConfigError(f"volume {volume.name!r} is in {volume.region}; this cluster would launch in {self.region}",
                              f"Launch it there: --region {volume.region}.")
        if spec.zones and volume.zone not in spec.zones:
            raise ConfigError(f"volume {volume.name!r} is in {volume.zone}, not in --zone {', '.join(spec.zones)}",
                              f"Leave --zone out (the cluster goes to {volume.zone}), or use a volume in "
                              f"{spec.zones[0]}.")
        return VolumeUse(name=volume.name, id=volume.id, path=volume.path or mount_point(volume.name), zone=volume.zone)

    def remove(self, volume: Volume, progress: Progress) -> None:
        now = self.describe(volume)
        if now is None:
            progress(f"volume {volume.id} was gone already")
            return
        if now.attached_to:
            raise ConflictError(f"volume {volume.name!r} is attached to {now.attached_to}",
                                f"`gpuctl down` its cluster first, then `gpuctl volume rm {volume.name}`.")
        ec2 = self.ctx.aws(volume.region or None).ec2()
        try:
            ec2.delete_volume(VolumeId=volume.id)
        except aws_errors() as exc:
            if error_code(exc) != "InvalidVolume.NotFound":
                raise translate(exc, "DeleteVolume") from exc
        progress(f"deleted volume {volume.id} ({volume.name}, {volume.size_gb} GB)")

    # --- up --volume ---------------------------------------------------------------------------

    def attach(self, use: VolumeUse, instance_id: str, progress: Progress) -> None:
        """Attach it to the chief (once: an `up` again finds it attached there) and wait."""
        now = self.describe_id(use.id)
        if now is None:
            raise CloudError(f"volume {use.name!r} ({use.id}) no longer exists",
                             "`gpuctl down` this cluster; `gpuctl volume create` makes a new volume.")
        if now.attached_to == instance_id:
            return
        ec2 = self.aws.ec2()
        if now.attached_to:
            # `up` refused a volume another live cluster has before launching: what holds it now is
            # an instance on its way out (a spot replacement's predecessor, EC2 ending it).
            progress(f"volume {use.name} is still attached to {now.attached_to}: waiting for EC2 to detach it")
            wait_for(ec2, "volume_available", self.ctx.spec.wait_timeout_s, what=f"volume {use.id} to be detached",
                     hint=f"`gpuctl down` the cluster of {now.attached_to} first.", VolumeIds=[use.id])
        call(ec2.attach_volume, VolumeId=use.id, InstanceId=instance_id, Device=mount.DEVICE)
        wait_for(ec2, "volume_in_use", self.ctx.spec.wait_timeout_s, what=f"volume {use.id} to attach",
                 hint="`gpuctl down` releases the instance; the volume stays.", VolumeIds=[use.id])
        progress(f"volume {use.name} ({use.id}) attached to {instance_id}")

    def mount(self, host: Host, use: VolumeUse, user: str) -> tuple[str, str]:
        """Format (only a volume with nothing on it) and mount it on the chief; its path, and
        what the script did (its last line)."""
        res = host.run(mount.argv(use.id, use.path, user, f"gpuctl-{use.name}", seams.volume_devices(use.id)),
                       check=False, timeout=MOUNT_TIMEOUT_S, cwd=False)
        # The instance's words: one clean line each (no control sequence reaches the terminal).
        last = untrusted.one_line((res.stdout.strip().splitlines() or [""])[-1], 200)
        if res.returncode != 0 or not last.startswith(mount.DONE):
            why = untrusted.one_line((res.stderr.strip().splitlines() or [last or f"exit {res.returncode}"])[-1], 200)
            raise CloudError(f"volume {use.name!r} could not be mounted at {use.path}: {why}",
                             "`gpuctl ssh` in to look (lsblk, dmesg); `gpuctl down` leaves the volume as it is.")
        return use.path, last
