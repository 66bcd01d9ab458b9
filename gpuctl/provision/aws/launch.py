"""RunInstances across zones and markets, safe by default.

Every zone that offers the type is tried in turn (cheapest spot price first); capacity, quota and
price-too-low answers move on to the next zone, anything else stops at once. Spot may fall back
to on-demand. When every attempt fails, one error names each zone and its reason, and the hint
names the quota to raise.
"""

from __future__ import annotations

import hashlib
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
    if market == "spot":
        spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if plan.max_price > 0:
            spot["MaxPrice"] = f"{plan.max_price:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
    return params


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
                res = aws.ec2().run_instances(**run_params(plan, zone, market))
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
