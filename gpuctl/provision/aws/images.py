"""Which AMI an `up` boots, and why.

Since TF 2.18 AWS publishes no TensorFlow DLAMI; what it maintains is the Deep Learning Base OSS
Nvidia Driver GPU AMI (driver and CUDA, no framework). So an `up` looks, in this order, for:

1. `--image ami-...` (pinned): the user's word wins;
2. a baked image of this owner (`gpuctl image bake`): TF of the asked version already installed,
   on the asked base OS; a CPU-only bake (--allow-cpu) only for a type without a GPU;
3. a TensorFlow DLAMI of that version for `aws.base_os` (its "(Ubuntu 22.04)" in the name: AWS
   published them for Amazon Linux too, whose login user is not ubuntu), should AWS still publish
   one (`aws.image_pattern`, which must say where the version goes: {tf});
4. the Base OSS Nvidia Driver GPU AMI for `aws.base_os` and the type's architecture (the SSM
   public parameter first, DescribeImages as the fallback); gpuctl's setup step installs TF on it.

Each answer carries a one-line reason, which `up` prints. Nothing here creates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gpuctl.errors import CloudError, ConfigError
from gpuctl.provision import tf_matches
from gpuctl.provision.aws import access, catalog
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate

Progress = Callable[[str], None]

# The tags a baked image carries besides gpuctl's own three (access.tags).
TAG_TF = "gpuctl:tf-version"  # as asked (2.21)
TAG_TF_INSTALLED = "gpuctl:tf-installed"  # as installed (2.21.0)
TAG_TF_VARIANT = "gpuctl:tf-variant"  # cuda | cpu (an --allow-cpu bake: never for a GPU type)
TAG_BASE_IMAGE = "gpuctl:base-image"
TAG_BASE_OS = "gpuctl:base-os"
TAG_PACKAGES = "gpuctl:packages"  # a requirements file baked in: "requirements.txt (sha256 1a2b3c4d)"

# The SSM public parameter of the newest Base OSS GPU AMI. AWS's naming rule (find-dlami-id: the
# AMI's name without "deep", "learning" and "ami") gives "base-oss-nvidia-driver-gpu-ubuntu-22.04"
# for "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)"; a spelling without "gpu-"
# also circulates, which is one reason DescribeImages stays as the fallback.
BASE_PARAMETER = "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-{os}/latest/ami-id"
# "Deep Learning ARM64 Base OSS ..." is the arm64 build: the architecture filter tells them apart.
BASE_PATTERN = "Deep Learning*Base OSS Nvidia Driver GPU AMI ({os})*"
BASE_OS_NAMES = {"ubuntu-22.04": "Ubuntu 22.04", "ubuntu-24.04": "Ubuntu 24.04"}


@dataclass(frozen=True)
class Chosen:
    image: dict[str, Any]  # DescribeImages' answer for it
    kind: str  # pinned | baked | dlami | base
    why: str  # one line for `up` to print

    @property
    def id(self) -> str:
        return str(self.image["ImageId"])

    @property
    def name(self) -> str:
        return str(self.image.get("Name") or "?")


def tag(image: dict[str, Any], key: str) -> str | None:
    return next((t["Value"] for t in image.get("Tags", []) if t["Key"] == key), None)


def _newest(images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(images, key=lambda i: (i.get("CreationDate", ""), i.get("Name", "")), reverse=True)


def described(aws: Aws, owners: list[str], filters: list[dict[str, Any]], architecture: str | None = None,
              any_state: bool = False) -> list[dict[str, Any]]:
    """Available images (or in any state: pending, failed...) of these owners matching the filters
    (and architecture), newest first."""
    filters = filters + ([] if any_state else [{"Name": "state", "Values": ["available"]}])
    if architecture:
        filters.append({"Name": "architecture", "Values": [architecture]})
    return _newest(call(aws.ec2().describe_images, Owners=owners, Filters=filters).get("Images", []))


def image_by_id(aws: Aws, image_id: str) -> dict[str, Any]:
    """One image by id; a malformed or unknown id is a clear error (DescribeImages answers an
    id deregistered a while ago with nothing, not an error)."""
    check_image_id(image_id)
    images = call(aws.ec2().describe_images, ImageIds=[image_id]).get("Images", [])
    if not images:
        raise CloudError(f"AMI {image_id} not found in {aws.region}",
                         "AMI ids differ per region: look it up in this one (`gpuctl image ls` lists your baked ones).")
    return images[0]


def check_image_id(image_id: str) -> None:
    import re

    if not re.fullmatch(r"ami-[0-9a-f]{8}([0-9a-f]{9})?", image_id or ""):
        raise ConfigError(f"{image_id!r} is not an AMI id",
                          "An AMI id looks like ami-0123456789abcdef0 (`gpuctl image ls` lists your baked ones).")


def baked_images(aws: Aws, owner: str, architecture: str | None = None, any_state: bool = False
                 ) -> list[dict[str, Any]]:
    """This owner's images made by `gpuctl image bake` in the region, newest first (available
    ones only, unless any_state)."""
    return described(aws, ["self"], access.owner_filters(owner), architecture, any_state)


def serves(image: dict[str, Any], tf: str) -> bool:
    """Whether a baked image serves `--tf tf`: asked as it was baked (2.21 for a 2.21 bake) or as
    it is installed (2.21.0); images baked before gpuctl:tf-installed carry the installed one."""
    return tf_matches(tf, tag(image, TAG_TF)) or tf_matches(tf, tag(image, TAG_TF_INSTALLED))


def resolve(aws: Aws, spec: Any, architecture: str, owner: str, gpus: bool = True) -> Chosen:
    """The image an `up` of this spec boots (see the module docstring for the order); `gpus`:
    whether the type has any (a CPU-only bake is never chosen for one that does)."""
    if spec.image:
        image = image_by_id(aws, spec.image)
        return Chosen(image, "pinned", f"pinned with --image (or `aws.image`): {image.get('Name') or spec.image}")
    pattern = dlami_pattern(spec)
    tf, skipped = spec.tensorflow, []
    for image in baked_images(aws, owner, architecture):
        if not serves(image, tf) or tag(image, TAG_BASE_OS) not in (None, spec.base_os):
            continue
        if gpus and tag(image, TAG_TF_VARIANT) == "cpu":
            skipped.append(image["ImageId"])
            continue
        return Chosen(image, "baked", f"your baked image with TensorFlow {tag(image, TAG_TF_INSTALLED) or tag(image, TAG_TF)} "
                                      f"(`gpuctl image bake`): no setup step needed")
    note = (f" (skipped your CPU-only bake {', '.join(skipped)}: {spec.instance_type} has a GPU, its TensorFlow "
            "would not use it)" if skipped else "")
    os_name = BASE_OS_NAMES[spec.base_os]
    dlamis = [i for i in described(aws, ["amazon"], [{"Name": "name", "Values": [pattern]}], architecture)
              if f"({os_name})" in str(i.get("Name"))]  # AWS published them for Amazon Linux too
    if dlamis:
        return Chosen(dlamis[0], "dlami", f"AWS's TensorFlow {tf} Deep Learning AMI for {os_name} (named like "
                                          f"{pattern!r}){note}")
    chosen = base(aws, spec, architecture, also=f"no baked image of yours, no DLAMI named like {pattern!r} "
                                                f"for {os_name}")
    return Chosen(chosen.image, chosen.kind, chosen.why + note)


def dlami_pattern(spec: Any) -> str:
    """aws.image_pattern with the version (and OS, where it says {os}) put in; a pattern without
    {tf} (an old config) would match a TensorFlow DLAMI of any version, so it is refused."""
    if "{tf}" not in spec.image_pattern:
        raise ConfigError(f"aws.image_pattern {spec.image_pattern!r} has no {{tf}}: it would match a TensorFlow "
                          "DLAMI of any version",
                          "Put {tf} where the version goes (the default: 'Deep Learning*AMI GPU TensorFlow {tf} (*'), "
                          "or remove the setting.")
    return spec.image_pattern.replace("{tf}", spec.tensorflow).replace("{os}", BASE_OS_NAMES[spec.base_os])


def base(aws: Aws, spec: Any, architecture: str, also: str = "") -> Chosen:
    """The Base OSS Nvidia Driver GPU AMI for the spec (what the setup step and a bake start
    from); an error naming everything looked for when the region has none."""
    tf = spec.tensorflow
    image, looked = base_image(aws, spec.base_os, architecture)
    if image is None:
        raise CloudError(
            f"no image for TensorFlow {tf} on {architecture} in {aws.region}: {also + ', and ' if also else ''}"
            f"no base image ({'; '.join(looked)})",
            "Pin an AMI with --image ami-..., or try another region (--region).",
        )
    refuse_on_base(spec.instance_type)
    return Chosen(image, "base", f"no baked image or TensorFlow DLAMI for TF {tf} here: AWS's driver-only base "
                                 f"image ({looked[-1]}); the setup step installs TensorFlow {tf} on it "
                                 f"(tensorflow[and-cuda]=={_wildcard(tf)})")


def _wildcard(tf: str) -> str:
    return tf + ".*" if tf.count(".") == 1 else tf


def refuse_on_base(instance_type: str) -> None:
    if not catalog.on_base(instance_type):
        raise ConfigError(
            f"{instance_type} cannot boot the Base OSS Nvidia Driver GPU AMI: its driver supports G4dn, G5, G6, G6e, "
            "P4 and P5, not the P2/P3 families",
            f"Pick another type ({catalog.suggested_types()}), or pin an image that supports it "
            "with --image ami-...",
        )


def base_image(aws: Aws, base_os: str, architecture: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest Base OSS Nvidia Driver GPU AMI for the OS and architecture, and what was looked
    at (the last entry says where it was found)."""
    parameter = BASE_PARAMETER.format(arch=architecture, os=base_os)
    looked = [f"SSM parameter {parameter}"]
    image_id = _parameter(aws, parameter, looked)
    if image_id:
        images = call(aws.ec2().describe_images, ImageIds=[image_id]).get("Images", [])
        if images:
            looked.append(f"{images[0].get('Name') or image_id}, from SSM parameter {parameter}")
            return images[0], looked
        looked[-1] += f" (names {image_id}, which DescribeImages does not know)"
    pattern = BASE_PATTERN.format(os=BASE_OS_NAMES[base_os])
    found = described(aws, ["amazon"], [{"Name": "name", "Values": [pattern]}], architecture)
    looked.append(f"DescribeImages owner amazon, name like {pattern!r}")
    if found:
        looked.append(f"{found[0].get('Name')}, the newest named like {pattern!r}")
        return found[0], looked
    return None, looked


def _parameter(aws: Aws, name: str, looked: list[str]) -> str | None:
    """The parameter's value, or None (noted in `looked`) when it is absent or not readable: the
    DescribeImages fallback still answers then."""
    try:
        return str(aws.client("ssm").get_parameter(Name=name)["Parameter"]["Value"])
    except aws_errors() as exc:
        code = error_code(exc)
        if code == "ParameterNotFound":
            looked[-1] += " (not published in this region)"
        elif code in ("AccessDeniedException", "AccessDenied", "UnauthorizedOperation"):
            looked[-1] += " (not readable: grant ssm:GetParameter, see docs/aws-iam.md)"
        else:
            raise translate(exc, "GetParameter") from exc
    return None
