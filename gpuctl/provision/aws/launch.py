"""One RunInstances request, safe by default: IMDSv2 required, encrypted gp3, the cluster's own
group, key and instance profile, shutdown = terminate, gpuctl's tags at creation. The loop over
zones, markets and nodes is nodes.py's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

from gpuctl.provision.aws.access import tag_spec
from gpuctl.provision.aws.session import Aws, aws_errors, error_code, error_message
from gpuctl.retry import Backoff


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
    user_data: str | bytes  # the script itself (gzipped: userdata.py): boto3 base64-encodes RunInstances' UserData
    token_seed: str  # the same `up` retried reuses the same client tokens
    instance_profile: str = ""  # the cluster's (store_iam.py): its checkpoints' credentials; "" = none
    nodes: int = 1  # all in one zone or none (nodes.py)
    placement_group: str = ""  # a cluster placement group the nodes share; "" = none
    wait_timeout_s: float = 900.0  # for the nodes of a zone that failed to end
    # IMDS answers this many hops away: 1 = the instance's own processes only; 2 also reaches
    # containers on it (and so the cluster's role), only when aws.imds_for_containers asks.
    imds_hop_limit: int = 1


def client_token(plan: LaunchPlan, zone: str, market: str, node: int = 0, generation: int = 0) -> str:
    """Idempotency: an `up` killed after sending a request and rerun gets the same instance back.
    A node rolled back in a zone used its token up (EC2 keeps it a day): a later attempt there
    asks with the next generation's."""
    seed = f"{plan.token_seed}|{zone}|{market}|node{node}" + (f"|g{generation}" if generation else "")
    return hashlib.sha256(seed.encode()).hexdigest()[:64]


def run_params(plan: LaunchPlan, zone: str, market: str, node: int = 0, generation: int = 0) -> dict[str, Any]:
    """The RunInstances request for one node in one attempt: every safety default is set here, in
    one place."""
    params: dict[str, Any] = {
        "ImageId": plan.image_id,
        "InstanceType": plan.instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "KeyName": plan.key_name,
        "UserData": plan.user_data,
        "InstanceInitiatedShutdownBehavior": "terminate",  # poweroff (guards) ends billing
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": plan.imds_hop_limit},
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
        # The rank is tagged at creation, so that one read back (reuse, `status --all`) keeps it.
        "TagSpecifications": [
            tag_spec("instance", plan.cluster, plan.owner, node),
            tag_spec("volume", plan.cluster, plan.owner, node),
        ],
        "ClientToken": client_token(plan, zone, market, node, generation),
    }
    if plan.placement_group:
        params["Placement"] = {"GroupName": plan.placement_group}
    if plan.instance_profile:
        params["IamInstanceProfile"] = {"Name": plan.instance_profile}
    if market == "spot":
        spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if plan.max_price > 0:
            spot["MaxPrice"] = f"{plan.max_price:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
    return params


# IAM is eventually consistent: for some seconds after CreateInstanceProfile, RunInstances answers
# InvalidParameterValue "Invalid IAM Instance Profile name". Retried PROFILE_RETRIES times, after
# pauses of 1, 2, 4, 8, 8, 8 s (~30 s).
PROFILE_RETRIES = 6
PROFILE_FIRST_S, PROFILE_MAX_S = 1.0, 8.0


def _profile_not_seen_yet(exc: BaseException) -> bool:
    return error_code(exc) == "InvalidParameterValue" and "iam instance profile" in error_message(exc).lower()


def run_instances(aws: Aws, params: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """RunInstances, again while EC2 does not see a new instance profile yet (same request, same
    client token: a refused request made nothing)."""

    pauses = Backoff(PROFILE_FIRST_S, PROFILE_MAX_S, clock=aws.clock)
    for left in range(PROFILE_RETRIES, -1, -1):
        try:
            launched: dict[str, Any] = aws.ec2().run_instances(**params)
            return launched
        except aws_errors() as exc:
            if not left or not params.get("IamInstanceProfile") or not _profile_not_seen_yet(exc):
                raise
            progress(f"EC2 does not see instance profile {params['IamInstanceProfile']['Name']} yet (IAM takes "
                     f"seconds to spread); again in {pauses.delay:g}s")
            pauses.pause()
    raise AssertionError("unreachable")
