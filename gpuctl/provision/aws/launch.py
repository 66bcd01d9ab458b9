"""RunInstances across zones and markets, safe by default.

Every zone that offers the type is tried in turn (cheapest spot price first); capacity, quota and
price-too-low answers move on to the next zone, anything else stops at once. Spot may fall back
to on-demand. When every attempt fails, one error names each zone and its reason, and the hint
names the quota to raise.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuctl.errors import NoCapacityError
from gpuctl.provision.aws.access import tag_spec
from gpuctl.provision.aws.session import (
    CAPACITY_CODES,
    QUOTA_CODES,
    Aws,
    error_code,
    error_message,
    quota_hint,
    translate,
)


@dataclass(frozen=True)
class LaunchPlan:
    cluster: str
    owner: str
    instance_type: str
    image_id: str
    root_device: str
    key_name: str
    security_group: str
    subnets: dict[str, str]  # zone -> subnet, in the order to try
    market: str  # spot | on-demand
    max_price: float  # 0 = no cap
    fallback_on_demand: bool
    disk_gb: int
    user_data: str  # the script itself: boto3 base64-encodes RunInstances' UserData
    token_seed: str  # the same `up` retried reuses the same client tokens
    instance_profile: str = ""  # the cluster's (store_iam.py): its checkpoints' credentials; "" = none


def run_params(plan: LaunchPlan, zone: str, market: str) -> dict[str, Any]:
    """The RunInstances request for one attempt: every safety default is set here, in one place."""
    params: dict[str, Any] = {
        "ImageId": plan.image_id,
        "InstanceType": plan.instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "KeyName": plan.key_name,
        "UserData": plan.user_data,
        "InstanceInitiatedShutdownBehavior": "terminate",  # poweroff (guards) ends billing
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2},
        "NetworkInterfaces": [{
            "DeviceIndex": 0,
            "SubnetId": plan.subnets[zone],
            "Groups": [plan.security_group],
            "AssociatePublicIpAddress": True,
            "DeleteOnTermination": True,
        }],
        "BlockDeviceMappings": [{
            "DeviceName": plan.root_device,
            "Ebs": {"VolumeSize": plan.disk_gb, "VolumeType": "gp3", "Encrypted": True, "DeleteOnTermination": True},
        }],
        "TagSpecifications": [
            tag_spec("instance", plan.cluster, plan.owner),
            tag_spec("volume", plan.cluster, plan.owner),
        ],
        # Idempotency: an `up` killed after sending this and rerun gets the same instance back.
        "ClientToken": hashlib.sha256(f"{plan.token_seed}|{zone}|{market}".encode()).hexdigest()[:64],
    }
    if plan.instance_profile:
        params["IamInstanceProfile"] = {"Name": plan.instance_profile}
    if market == "spot":
        spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if plan.max_price > 0:
            spot["MaxPrice"] = f"{plan.max_price:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
    return params


# IAM is eventually consistent: for some seconds after CreateInstanceProfile, RunInstances answers
# InvalidParameterValue "Invalid IAM Instance Profile name". Retried after these pauses (~30 s).
PROFILE_RETRY_S = (1.0, 2.0, 4.0, 8.0, 8.0, 8.0)


def _profile_not_seen_yet(exc: BaseException) -> bool:
    return error_code(exc) == "InvalidParameterValue" and "iam instance profile" in error_message(exc).lower()


def _run_instances(aws: Aws, params: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """RunInstances, again while EC2 does not see a new instance profile yet (same request, same
    client token: a refused request made nothing)."""
    from botocore.exceptions import ClientError

    for pause in (*PROFILE_RETRY_S, None):
        try:
            return aws.ec2().run_instances(**params)
        except ClientError as exc:
            if pause is None or not params.get("IamInstanceProfile") or not _profile_not_seen_yet(exc):
                raise
            progress(f"EC2 does not see instance profile {params['IamInstanceProfile']['Name']} yet (IAM takes "
                     f"seconds to spread); again in {pause:g}s")
            time.sleep(pause)
    raise AssertionError("unreachable")


def launch_one(aws: Aws, plan: LaunchPlan, progress: Callable[[str], None]) -> tuple[dict[str, Any], str]:
    """Try zones (and markets) in order; return (the instance description, market used)."""
    from botocore.exceptions import ClientError

    markets = [plan.market] + (["on-demand"] if plan.market == "spot" and plan.fallback_on_demand else [])
    failures: list[str] = []
    quota = False
    for market in markets:
        for zone in plan.subnets:
            progress(f"requesting {plan.instance_type} ({market}) in {zone}")
            try:
                res = _run_instances(aws, run_params(plan, zone, market), progress)
                return res["Instances"][0], market
            except ClientError as exc:
                code = error_code(exc)
                if code not in CAPACITY_CODES:
                    raise translate(exc, "RunInstances") from exc
                quota = quota or code in QUOTA_CODES
                failures.append(f"{zone} {market}: {code}")
                progress(f"{zone} {market}: {code}: {error_message(exc)[:120]}")
    hint = "Try again later, another region (--region), or on-demand (--on-demand / --fallback-on-demand)."
    if quota:
        hint = quota_hint(plan.instance_type, plan.market) + " " + hint
    raise NoCapacityError(f"no capacity for {plan.instance_type}: " + "; ".join(failures), hint)
