"""Images gpuctl bakes on EC2: made from its instance, listed and removed by their tags.

An image is tagged at creation like everything gpuctl makes (cluster, owner, created-by) and with
what it carries (TF version asked and installed, CUDA or CPU build, base image and OS); its
snapshots get the same tags in the same CreateImage call (TagSpecifications "snapshot"), so no
moment exists where a snapshot of gpuctl's is untagged (IAM lets `image rm` delete only tagged
ones, and never lets gpuctl tag an existing snapshot). Removing deregisters the image, then
deletes its snapshots, which would otherwise go on costing storage.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, Callable

from gpuctl.errors import CloudError, ConflictError, NotFoundError
from gpuctl.model.images import BakeContents, BakedImage
from gpuctl.model.records import InstanceRecord
from gpuctl.provision import TF_VERSION
from gpuctl.provision.aws import access, catalog, images
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate, wait_for

Progress = Callable[[str], None]
IMAGE_TIMEOUT_S = 3600.0  # CreateImage of a 100 GB root volume takes 10 to 30 minutes


def _created(image: dict[str, Any]) -> float:
    raw = str(image.get("CreationDate") or "")
    try:
        return dt.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def _snapshot_ids(image: dict[str, Any]) -> tuple[str, ...]:
    return tuple(m["Ebs"]["SnapshotId"] for m in image.get("BlockDeviceMappings", [])
                 if m.get("Ebs", {}).get("SnapshotId"))


class AwsImages:
    """The ImageStore of the aws provider, in the provider's region, for its owner."""

    def __init__(self, ctx: AwsContext):
        self.ctx = ctx
        self.aws: Aws = ctx.aws(ctx.spec.region)
        self.region = self.aws.region

    def _record(self, image: dict[str, Any]) -> BakedImage:
        snapshots = _snapshot_ids(image)
        return BakedImage(
            id=image["ImageId"], region=self.aws.region, name=str(image.get("Name") or ""),
            tensorflow=images.tag(image, images.TAG_TF), tf_installed=images.tag(image, images.TAG_TF_INSTALLED),
            tf_variant=images.tag(image, images.TAG_TF_VARIANT), base_image=images.tag(image, images.TAG_BASE_IMAGE),
            base_os=images.tag(image, images.TAG_BASE_OS), cluster=images.tag(image, access.TAG_CLUSTER),
            packages=images.tag(image, images.TAG_PACKAGES),
            created_at=_created(image), size_gb=self._size_gb(image, snapshots), snapshots=snapshots,
            state=str(image.get("State") or "available"))

    def _size_gb(self, image: dict[str, Any], snapshots: tuple[str, ...]) -> float:
        """The data its snapshots hold where EC2 reports it (FullSnapshotSizeInBytes), else their
        volumes' provisioned size: an upper bound of what snapshot storage bills."""
        provisioned = float(sum(m.get("Ebs", {}).get("VolumeSize") or 0 for m in image.get("BlockDeviceMappings", [])))
        if not snapshots:
            return provisioned
        found = call(self.aws.ec2().describe_snapshots, SnapshotIds=list(snapshots)).get("Snapshots", [])
        data = [s.get("FullSnapshotSizeInBytes") for s in found]
        if found and all(data):
            return round(sum(data) / 1e9, 2)
        return provisioned or float(sum(s.get("VolumeSize") or 0 for s in found))

    # --- the ImageStore protocol ---------------------------------------------------------------

    def images(self) -> list[BakedImage]:
        return [self._record(i) for i in images.baked_images(self.aws, self.ctx.owner, any_state=True)]

    def bake_base(self, progress: Progress) -> str:
        spec = self.ctx.spec
        arch = catalog.architecture(catalog.instance_type_info(self.aws, spec.instance_type))
        chosen = images.base(self.aws, spec, arch)
        progress(f"bake: starting from {chosen.name} ({chosen.id}): {chosen.why}")
        return chosen.id

    def capture(self, instance: InstanceRecord, contents: BakeContents, progress: Progress,
                created: Callable[[BakedImage], None]) -> BakedImage:
        spec, ec2 = self.ctx.spec, self.aws.ec2()
        for version in (contents.tensorflow, contents.installed):  # they go into a name and tags
            if not TF_VERSION.fullmatch(version):
                raise CloudError(f"not baking: {version[:40]!r} is not a TensorFlow version")
        iid = instance.id
        if self._spot(iid):
            # EC2 refuses to stop a one-time spot instance (UnsupportedOperation). CreateImage
            # without NoReboot reboots the instance itself, which spot allows: the disk is imaged
            # with every write flushed all the same.
            progress(f"{iid} is a spot instance, which EC2 cannot stop: CreateImage reboots it to image its disk")
        else:
            # Stopped first: an image of a running instance may catch pip's files half-written.
            progress(f"stopping {iid} to image its disk")
            call(ec2.stop_instances, InstanceIds=[iid])
            wait_for(ec2, "instance_stopped", spec.wait_timeout_s, what=f"{iid} to stop",
                     hint=f"`gpuctl down {spec.name} -y` releases it.", InstanceIds=[iid])
        carries = {images.TAG_TF: contents.tensorflow, images.TAG_TF_INSTALLED: contents.installed,
                   images.TAG_TF_VARIANT: contents.variant, images.TAG_BASE_IMAGE: contents.base_image,
                   images.TAG_BASE_OS: spec.base_os, **({images.TAG_PACKAGES: contents.packages} if contents.packages else {})}
        tags = access.tags(spec.name, self.ctx.owner) + [{"Key": k, "Value": v} for k, v in carries.items()]
        cpu = "-cpu" if contents.variant == "cpu" else ""
        name = (f"gpuctl-tf{contents.installed}{cpu}-{spec.base_os}-{time.strftime('%Y%m%d-%H%M%S')}-"
                f"{spec.name[-4:]}")
        res = call(ec2.create_image, InstanceId=iid, Name=name,
                   Description=f"TensorFlow {contents.installed} ({contents.variant}) on {contents.base_image}, "
                               "baked by gpuctl",
                   TagSpecifications=[{"ResourceType": kind, "Tags": tags} for kind in ("image", "snapshot")])
        image_id = res["ImageId"]
        # Known locally before the long wait: a bake killed now still shows in `cost` and `image ls`.
        created(BakedImage(id=image_id, region=self.region, name=name, tensorflow=contents.tensorflow,
                           tf_installed=contents.installed, tf_variant=contents.variant,
                           base_image=contents.base_image, base_os=spec.base_os, cluster=spec.name,
                           packages=contents.packages,
                           created_at=time.time(), size_gb=float(spec.disk_gb), state="pending"))
        progress(f"image {image_id} ({name}): waiting for it to be available (10-30 minutes on EC2)")
        wait_for(ec2, "image_available", max(spec.wait_timeout_s, IMAGE_TIMEOUT_S), what=f"image {image_id}",
                 hint=f"It may still become available: `gpuctl image ls`; `gpuctl image rm {image_id} -y` removes it.",
                 ImageIds=[image_id])
        return self._record(call(ec2.describe_images, ImageIds=[image_id])["Images"][0])

    def _spot(self, instance_id: str) -> bool:
        """Whether EC2 runs it as spot (its own answer: a spot launch that fell back on-demand is not)."""
        found = call(self.aws.ec2().describe_instances, InstanceIds=[instance_id])["Reservations"]
        return any(i.get("InstanceLifecycle") == "spot" for r in found for i in r["Instances"])

    def remove(self, image_id: str, progress: Progress) -> BakedImage:
        ec2 = self.aws.ec2()
        image = self._ours(image_id)
        record = self._record(image)
        call(ec2.deregister_image, ImageId=image_id)
        progress(f"deregistered {image_id} ({record.name})")
        for snap in record.snapshots:
            self._delete_snapshot(ec2, snap)
            progress(f"deleted snapshot {snap}")
        return record

    def _ours(self, image_id: str) -> dict[str, Any]:
        """The image, if this install baked it; otherwise an error that changes nothing."""

        images.check_image_id(image_id)
        try:
            found = self.aws.ec2().describe_images(ImageIds=[image_id]).get("Images", [])
        except aws_errors() as exc:
            if not error_code(exc).startswith("InvalidAMIID"):
                raise translate(exc, "DescribeImages") from exc
            found = []
        if not found:
            raise NotFoundError(f"no image {image_id} in {self.aws.region}",
                                "`gpuctl image ls` lists your baked images; AMI ids differ per region (--region).")
        image = found[0]
        made_by = images.tag(image, access.TAG_CREATED_BY)
        owner = images.tag(image, access.TAG_OWNER)
        if made_by != "gpuctl" or owner != self.ctx.owner:
            whose = "not made by gpuctl" if made_by != "gpuctl" else f"baked by another gpuctl install ({owner})"
            raise ConflictError(f"image {image_id} is {whose}: not removing it",
                                "`gpuctl image rm` removes only the images `gpuctl image ls` lists; deregister "
                                "others in the EC2 console.")
        return image

    @staticmethod
    def _delete_snapshot(ec2: Any, snapshot_id: str) -> None:

        try:
            ec2.delete_snapshot(SnapshotId=snapshot_id)
        except aws_errors() as exc:
            if error_code(exc) != "InvalidSnapshot.NotFound":
                raise CloudError(f"image deregistered, but its snapshot {snapshot_id} was not deleted: "
                                 f"{error_code(exc)}", f"Delete it in the EC2 console (Snapshots), or "
                                 f"`aws ec2 delete-snapshot --snapshot-id {snapshot_id}`: it costs storage.") from exc
