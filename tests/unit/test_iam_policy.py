"""docs/aws-iam.md's policy, checked against every EC2 and Price List call gpuctl makes.

How: gpuctl's own code runs against a real boto3 client whose answers come from botocore's
Stubber, and every request it sends is recorded (so the tags, IMDSv2 and encryption settings
checked are the ones gpuctl really sends). Each request becomes the authorization checks AWS
documents for it (RunInstances authorizes the new instance, volume, network interface and spot
request and the image, subnet, group and key pair it uses; tags given at creation are also checked
as CreateTags with `ec2:CreateAction`), and the small evaluator below decides them the way IAM
does: action and ARN wildcards, the condition operators the policy uses, an explicit Deny wins,
anything not allowed is denied. An operator it does not know fails the test instead of passing.

Why not moto's IAM enforcement (`INITIAL_NO_AUTH_ACTION_COUNT`): moto 5.2 checks the action
against Resource "*" only and ignores Resource ARNs and conditions other than a trust policy's
StringEquals (moto/iam/access_control.py: "TODO add support for the Resource and Condition parts
of IAM policies"), so every condition that makes this policy least privilege would pass unchecked.
What this cannot prove is that AWS's authorization model is as modelled here (REQUESTS); that
follows AWS's Service Authorization Reference for EC2.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from gpuctl.errors import NoCapacityError
from gpuctl.model.records import Resource
from gpuctl.provision.aws import access, images, inventory, nodes, store_iam
from gpuctl.provision.aws import budget as aws_budget
from gpuctl.provision.aws import volumes as aws_volumes
from gpuctl.provision.aws.baked import AwsImages
from gpuctl.provision.aws.launch import LaunchPlan
from gpuctl.provision.aws.store import S3Store, bucket_name
from tests.waits import FakeClock

REPO = Path(__file__).resolve().parents[2]
REGION, ACCOUNT = "us-east-1", "123456789012"
CLUSTER, OWNER = "default", "alice@laptop-1a2b3c"
GPUCTL = {t["Key"]: t["Value"] for t in access.tags(CLUSTER, OWNER)}
FOREIGN = {"Name": "prod-db", "team": "data"}
KEY = access.resource_name(CLUSTER, OWNER)
BUCKET = bucket_name(ACCOUNT, REGION, OWNER)
PROFILE = store_iam.profile_name(OWNER, CLUSTER, REGION)
# Who carries which tags in the account the checks run in: gpuctl's resources carry the tags
# gpuctl's own create calls gave them (test_every_call... checks those calls are allowed).
AMI = "ami-0123456789abcdef0"
IMAGE_TAGS = {**GPUCTL, images.TAG_TF: "2.21", images.TAG_TF_INSTALLED: "2.21.0", images.TAG_TF_VARIANT: "cuda",
              images.TAG_BASE_IMAGE: "ami-0base", images.TAG_BASE_OS: "ubuntu-22.04"}
VOLUME_TAGS = {t["Key"]: t["Value"] for t in aws_volumes.tags("data", OWNER)}
WORLD = {"i-1": GPUCTL, "sg-1": GPUCTL, KEY: GPUCTL, AMI: IMAGE_TAGS, "snap-1": IMAGE_TAGS,
         "vol-1": VOLUME_TAGS, "vol-root": GPUCTL,  # a named volume; an instance's root volume (no gpuctl:volume)
         "i-foreign": FOREIGN, "sg-foreign": FOREIGN, "prod-key": FOREIGN, "ami-foreign": FOREIGN,
         "snap-foreign": FOREIGN, "pg-foreign": FOREIGN, "vol-foreign": FOREIGN}

Check = tuple[str, str, dict[str, Any]]  # (action, resource ARN, request context)


def policy() -> dict[str, Any]:
    text = (REPO / "docs" / "aws-iam.md").read_text()
    (block,) = re.findall(r"```json\n(.*?)```", text, re.S)
    return json.loads(block)


# --- the evaluator ----------------------------------------------------------------------------


def _glob(pattern: str, value: str, case: bool = True) -> bool:
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, value, 0 if case else re.I) is not None


def _arn_matches(pattern: str, arn: str) -> bool:
    if pattern == "*":
        return True
    # IAM matches an ARN segment by segment: a wildcard never reaches into the next segment.
    pat, val = pattern.split(":", 5), arn.split(":", 5)
    return len(pat) == len(val) == 6 and all(_glob(p, v) for p, v in zip(pat, val))


def _listed(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [x]


def _condition(op: str, key: str, expected: list[str], ctx: dict[str, Any]) -> bool:
    present = key in ctx
    if op.endswith("IfExists"):
        return not present or _condition(op[: -len("IfExists")], key, expected, ctx)
    if op == "Null":
        (want,) = expected
        return (not present) == (want == "true")
    match = {"StringEquals": lambda v, e: v == e, "StringLike": lambda v, e: _glob(e, v),  # (value, pattern)
             "Bool": lambda v, e: v.lower() == e.lower()}
    qualifier, _, base = op.rpartition(":")
    if base not in match or qualifier not in ("", "ForAllValues", "ForAnyValue"):
        raise AssertionError(f"the evaluator does not know {op}: teach it before the policy uses it")
    hit = lambda v: any(match[base](str(v), str(e)) for e in expected)  # noqa: E731
    if qualifier == "ForAllValues":  # true for a missing key, as IAM says
        return all(hit(v) for v in _listed(ctx.get(key, [])))
    if not present:
        return False
    if qualifier == "ForAnyValue":
        return any(hit(v) for v in _listed(ctx[key]))
    assert not isinstance(ctx[key], list), f"{key} is multi-valued: use ForAllValues/ForAnyValue"
    return hit(ctx[key])


def _applies(st: dict[str, Any], action: str, arn: str, ctx: dict[str, Any]) -> bool:
    assert not {"NotAction", "NotResource", "Principal"} & set(st), "the evaluator does not model these"
    return (any(_glob(a, action, case=False) for a in _listed(st["Action"]))
            and any(_arn_matches(r, arn) for r in _listed(st["Resource"]))
            and all(_condition(op, key, _listed(want), ctx)
                    for op, block in st.get("Condition", {}).items() for key, want in block.items()))


def decide(pol: dict[str, Any], action: str, arn: str, ctx: dict[str, Any]) -> str:
    effects = {st["Effect"] for st in pol["Statement"] if _applies(st, action, arn, ctx)}
    return "explicit deny" if "Deny" in effects else "allow" if "Allow" in effects else "implicit deny"


def refused(pol: dict[str, Any], checks: list[Check]) -> list[Check]:
    """The checks of one request that are not allowed (the request is allowed when none are)."""
    return [c for c in checks if decide(pol, *c) != "allow"]


# --- what AWS authorizes for each request --------------------------------------------------------


def arn(kind: str, rid: str) -> str:
    # Images and snapshots have no account in their ARN.
    return f"arn:aws:ec2:{REGION}:{'' if kind in ('image', 'snapshot') else ACCOUNT}:{kind}/{rid}"


def _tags(spec_list: list[dict[str, Any]], kind: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for s in spec_list if s["ResourceType"] == kind for t in s["Tags"]}


def _request_tags(tags: dict[str, str]) -> dict[str, Any]:
    return {**{f"aws:RequestTag/{k}": v for k, v in tags.items()}, **({"aws:TagKeys": list(tags)} if tags else {})}


def _existing(action: str, kind: str, rid: str) -> Check:
    return (f"ec2:{action}", arn(kind, rid), {f"aws:ResourceTag/{k}": v for k, v in WORLD.get(rid, {}).items()})


def _creating(action: str, kind: str, rid: str, tags: dict[str, str], ctx: dict[str, Any]) -> list[Check]:
    checks = [(f"ec2:{action}", arn(kind, rid), {**_request_tags(tags), **ctx})]
    if tags:  # TagSpecifications: CreateTags is authorized too, as part of the create call
        checks.append(("ec2:CreateTags", arn(kind, rid), {**_request_tags(tags), "ec2:CreateAction": action}))
    return checks


def _run_instances(p: dict[str, Any]) -> list[Check]:
    specs, ebs, nic = p.get("TagSpecifications", []), p["BlockDeviceMappings"][0]["Ebs"], p["NetworkInterfaces"][0]
    checks = _creating("RunInstances", "instance", "*", _tags(specs, "instance"), {
        "ec2:MetadataHttpTokens": p.get("MetadataOptions", {}).get("HttpTokens", "optional"),
        "ec2:InstanceType": p["InstanceType"]})
    checks += _creating("RunInstances", "volume", "*", _tags(specs, "volume"),
                        {"ec2:Encrypted": str(ebs.get("Encrypted", False)).lower(), "ec2:VolumeType": ebs["VolumeType"]})
    checks += _creating("RunInstances", "network-interface", "*", _tags(specs, "network-interface"), {})
    if p.get("InstanceMarketOptions", {}).get("MarketType") == "spot":
        checks += _creating("RunInstances", "spot-instances-request", "*", _tags(specs, "spot-instances-request"), {})
    checks += [_existing("RunInstances", "security-group", g) for g in nic["Groups"]]
    checks += [_existing("RunInstances", "key-pair", p["KeyName"]), _existing("RunInstances", "subnet", nic["SubnetId"]),
               _existing("RunInstances", "image", p["ImageId"])]
    if p.get("Placement", {}).get("GroupName"):
        checks.append(_existing("RunInstances", "placement-group", p["Placement"]["GroupName"]))
    if p.get("IamInstanceProfile"):  # the profile's role (one name for both) is passed to EC2
        checks.append(("iam:PassRole", iam_arn("role", p["IamInstanceProfile"]["Name"]),
                       {"iam:PassedToService": "ec2.amazonaws.com"}))
    return checks


def iam_arn(kind: str, name: str, owner: str = OWNER) -> str:
    """gpuctl's roles and profiles live under its owner's path /gpuctl/<H>/ (store_iam.owner_path);
    the budget's role and deny policy under /gpuctl-budget/; others under /."""
    if name in (aws_budget.ROLE, aws_budget.DENY):
        return f"arn:aws:iam::{ACCOUNT}:{kind}{aws_budget.IAM_PATH}{name}"
    return f"arn:aws:iam::{ACCOUNT}:{kind}{store_iam.owner_path(owner) if name.startswith('gpuctl-') else '/'}{name}"


BOUNDARY_ARN = f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}"
# Roles that carry the boundary: gpuctl's (CreateRole is allowed only with it), as IAM tells
# PutRolePolicy through `iam:PermissionsBoundary`. Any other role (an administrator's, even one
# put at gpuctl's path) has none.
BOUNDED_ROLES = {PROFILE}


def _role_policy(op: str) -> Callable[[dict[str, Any]], list[Check]]:
    def checks(p: dict[str, Any]) -> list[Check]:
        name = p.get("RoleName", PROFILE)
        arn_ = p.get("_arn") or iam_arn("role", name)
        return [(f"iam:{op}", arn_, {"iam:PermissionsBoundary": BOUNDARY_ARN} if name in BOUNDED_ROLES else {})]
    return checks


def _iam_creating(noun: str, kind: str, name: str, p: dict[str, Any], ctx: dict[str, Any]) -> list[Check]:
    """CreateRole / CreateInstanceProfile, with Tags: iam:Tag<noun> is authorized too."""
    tags = {t["Key"]: t["Value"] for t in p.get("Tags", [])}
    checks = [(f"iam:Create{noun}", iam_arn(kind, name), {**_request_tags(tags), **ctx})]
    if tags:
        checks.append((f"iam:Tag{noun}", iam_arn(kind, name), _request_tags(tags)))
    return checks


def _budget_arn(p: dict[str, Any]) -> str:
    name = p.get("BudgetName") or p.get("Budget", {}).get("BudgetName") or p.get("NewBudget", {}).get("BudgetName")
    return f"arn:aws:budgets::{ACCOUNT}:budget/{name or aws_budget.NAME}"


def _s3(action: str) -> Callable[[dict[str, Any]], list[Check]]:
    return lambda p: [(f"s3:{action}", f"arn:aws:s3:::{p.get('Bucket', BUCKET)}", {})]


def _anywhere(service: str, op: str) -> Callable[[dict[str, Any]], list[Check]]:
    return lambda p: [(f"{service}:{op}", "*", {})]


def _on(op: str, kind: str, param: str) -> Callable[[dict[str, Any]], list[Check]]:
    return lambda p: [_existing(op, kind, rid) for rid in _listed(p[param])]


REQUESTS: dict[str, Callable[[dict[str, Any]], list[Check]]] = {
    **{f"ec2:{op}": _anywhere("ec2", op) for op in (
        "DescribeRegions", "DescribeInstanceTypes", "DescribeInstanceTypeOfferings", "DescribeSpotPriceHistory",
        "DescribeImages", "DescribeVpcs", "DescribeSubnets", "DescribeKeyPairs", "DescribeSecurityGroups",
        "DescribeInstances", "DescribePlacementGroups", "DescribeVolumes")},
    "pricing:GetProducts": _anywhere("pricing", "GetProducts"),
    "ec2:RunInstances": _run_instances,
    "ec2:ImportKeyPair": lambda p: _creating("ImportKeyPair", "key-pair", p["KeyName"],
                                             _tags(p.get("TagSpecifications", []), "key-pair"), {}),
    "ec2:CreateSecurityGroup": lambda p: [
        *_creating("CreateSecurityGroup", "security-group", "*", _tags(p.get("TagSpecifications", []), "security-group"), {}),
        _existing("CreateSecurityGroup", "vpc", p["VpcId"])],
    "ec2:CreatePlacementGroup": lambda p: _creating("CreatePlacementGroup", "placement-group", p["GroupName"],
                                                    _tags(p.get("TagSpecifications", []), "placement-group"), {}),
    "ec2:DeletePlacementGroup": _on("DeletePlacementGroup", "placement-group", "GroupName"),
    "ec2:AuthorizeSecurityGroupIngress": _on("AuthorizeSecurityGroupIngress", "security-group", "GroupId"),
    "ec2:RevokeSecurityGroupIngress": _on("RevokeSecurityGroupIngress", "security-group", "GroupId"),
    "ec2:DeleteSecurityGroup": _on("DeleteSecurityGroup", "security-group", "GroupId"),
    "ec2:DeleteKeyPair": _on("DeleteKeyPair", "key-pair", "KeyName"),
    "ec2:TerminateInstances": _on("TerminateInstances", "instance", "InstanceIds"),
    "ec2:StopInstances": _on("StopInstances", "instance", "InstanceIds"),
    # CreateImage authorizes the instance it images, the new image and the new snapshots, each with
    # the tags given for it.
    "ec2:CreateImage": lambda p: [
        _existing("CreateImage", "instance", p["InstanceId"]),
        *_creating("CreateImage", "image", "*", _tags(p.get("TagSpecifications", []), "image"), {}),
        *_creating("CreateImage", "snapshot", "*", _tags(p.get("TagSpecifications", []), "snapshot"), {})],
    "ec2:CreateVolume": lambda p: _creating("CreateVolume", "volume", "*", _tags(p.get("TagSpecifications", []), "volume"),
                                            {"ec2:Encrypted": str(p.get("Encrypted", False)).lower(),
                                             "ec2:VolumeType": p.get("VolumeType", "gp2")}),
    # AttachVolume authorizes the volume and the instance it is attached to.
    "ec2:AttachVolume": lambda p: [_existing("AttachVolume", "volume", p["VolumeId"]),
                                   _existing("AttachVolume", "instance", p["InstanceId"])],
    "ec2:DeleteVolume": _on("DeleteVolume", "volume", "VolumeId"),
    "ec2:DeregisterImage": _on("DeregisterImage", "image", "ImageId"),
    "ec2:DeleteSnapshot": _on("DeleteSnapshot", "snapshot", "SnapshotId"),
    "ec2:DescribeSnapshots": _anywhere("ec2", "DescribeSnapshots"),
    "ec2:CreateTags": lambda p: [
        (c[0], c[1], {**c[2], **_request_tags({t["Key"]: t["Value"] for t in p.get("Tags", [])})})
        for c in (_existing("CreateTags", "snapshot" if rid.startswith("snap-") else "instance", rid)
                  for rid in p["Resources"])],
    **{f"iam:{op}": _anywhere("iam", op) for op in ("ListRoles", "ListInstanceProfiles")},
    "iam:GetPolicy": lambda p: [("iam:GetPolicy", p.get("PolicyArn", BOUNDARY_ARN), {})],
    "iam:CreateRole": lambda p: _iam_creating("Role", "role", p["RoleName"], p, {
        **({"iam:PermissionsBoundary": p["PermissionsBoundary"]} if p.get("PermissionsBoundary") else {})}),
    "iam:CreateInstanceProfile": lambda p: _iam_creating("InstanceProfile", "instance-profile",
                                                         p["InstanceProfileName"], p, {}),
    **{f"iam:{op}": _role_policy(op) for op in ("PutRolePolicy", "DeleteRolePolicy", "ListRolePolicies",
                                                 "ListRoleTags", "DeleteRole")},
    **{f"iam:{op}": (lambda op: lambda p: [(f"iam:{op}", iam_arn("instance-profile", p.get("InstanceProfileName", PROFILE)), {})])(op)
       for op in ("GetInstanceProfile", "DeleteInstanceProfile")},
    # The role goes to EC2 with the profile: PassRole on it too (AWS's note on the operation).
    "iam:AddRoleToInstanceProfile": lambda p: [
        ("iam:AddRoleToInstanceProfile", iam_arn("instance-profile", p["InstanceProfileName"]), {}),
        ("iam:PassRole", iam_arn("role", p["RoleName"]), {"iam:PassedToService": "ec2.amazonaws.com"})],
    "iam:RemoveRoleFromInstanceProfile": lambda p: [
        ("iam:RemoveRoleFromInstanceProfile", iam_arn("instance-profile", p["InstanceProfileName"]), {})],
    "sts:GetCallerIdentity": lambda p: [],  # answers every identity: no permission to grant
    # The bill (Cost Explorer has no resource-level permissions) and the budget (docs/billing.md).
    **{f"ce:{op}": _anywhere("ce", op) for op in ("GetCostAndUsage", "ListCostAllocationTags",
                                                  "UpdateCostAllocationTagsStatus")},
    # Budgets' actions are not its operations' names (the Service Authorization Reference).
    **{f"budgets:{op}": (lambda action: lambda p: [(f"budgets:{action}", _budget_arn(p), {})])(action)
       for op, action in (("DescribeBudget", "ViewBudget"), ("CreateBudget", "ModifyBudget"),
                          ("UpdateBudget", "ModifyBudget"), ("DeleteBudget", "ModifyBudget"),
                          ("DescribeBudgetActionsForBudget", "DescribeBudgetActionsForBudget"))},
    # CreateBudgetAction passes the role AWS Budgets runs the action with.
    "budgets:CreateBudgetAction": lambda p: [
        ("budgets:CreateBudgetAction", _budget_arn(p) + "/action/*", {}),
        ("iam:PassRole", p["ExecutionRoleArn"], {"iam:PassedToService": "budgets.amazonaws.com"})],
    **{f"budgets:{op}": (lambda op: lambda p: [(f"budgets:{op}", f"{_budget_arn(p)}/action/{p['ActionId']}", {})])(op)
       for op in ("UpdateBudgetAction", "DeleteBudgetAction", "ExecuteBudgetAction")},
    "iam:CreatePolicy": lambda p: [("iam:CreatePolicy", f"arn:aws:iam::{ACCOUNT}:policy{p.get('Path', '/')}{p['PolicyName']}",
                                    {})],
    "iam:DeletePolicy": lambda p: [("iam:DeletePolicy", p["PolicyArn"], {})],
    # S3's actions are not its operations' names (the Service Authorization Reference for S3).
    "s3:HeadBucket": _s3("ListBucket"),
    "s3:ListObjectsV2": _s3("ListBucket"),
    "s3:CreateBucket": _s3("CreateBucket"),
    "s3:PutBucketEncryption": _s3("PutEncryptionConfiguration"),
    "s3:PutPublicAccessBlock": _s3("PutBucketPublicAccessBlock"),
    "s3:PutBucketPolicy": _s3("PutBucketPolicy"),
    "s3:PutBucketLifecycleConfiguration": _s3("PutLifecycleConfiguration"),
    "s3:PutBucketVersioning": _s3("PutBucketVersioning"),
    "s3:PutBucketTagging": _s3("PutBucketTagging"),
    "s3:GetBucketTagging": _s3("GetBucketTagging"),
    "s3:CopyObject": lambda p: [("s3:GetObject", f"arn:aws:s3:::{p['CopySource']['Bucket']}/{p['CopySource']['Key']}", {}),
                                ("s3:PutObject", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}", {})],
    # `data push` (boto3's managed upload: one PutObject, or a multipart upload) and `data rm`:
    # s3:PutObject covers every part; an abandoned upload is aborted (s3:AbortMultipartUpload).
    **{f"s3:{op}": (lambda p: [("s3:PutObject", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}", {})])
       for op in ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")},
    "s3:AbortMultipartUpload": lambda p: [("s3:AbortMultipartUpload", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}", {})],
    "s3:DeleteObject": lambda p: [("s3:DeleteObject", f"arn:aws:s3:::{p['Bucket']}/{p['Key']}", {})],
    "s3:DeleteObjects": lambda p: [("s3:DeleteObject", f"arn:aws:s3:::{p['Bucket']}/{o['Key']}", {})
                                   for o in p["Delete"]["Objects"]],
    # AWS's public parameters live in no account; the one gpuctl reads is named in images.py.
    "ssm:GetParameter": lambda p: [("ssm:GetParameter", f"arn:aws:ssm:{REGION}::parameter"
                                    + p.get("Name", images.BASE_PARAMETER.format(arch="x86_64", os="ubuntu-22.04")),
                                    {})],
}


# --- the calls in gpuctl's code, and the requests it really sends ----------------------------------


@functools.cache
def calls_in_code() -> frozenset[str]:
    """Every EC2 and Price List operation named in provision/aws (as a client method, a paginator
    or a waiter), as IAM actions."""
    import botocore.exceptions
    import botocore.session
    from botocore import xform_name

    source = "\n".join(p.read_text() for p in sorted((REPO / "gpuctl" / "provision" / "aws").glob("*.py")))
    services = set(re.findall(r"client\(\s*\"(\w+)\"", source))
    assert services == {"ec2", "pricing", "ssm", "iam", "s3", "sts", "ce", "budgets"}, \
        f"a new AWS service is called: add its actions to the policy ({services})"
    session, found = botocore.session.get_session(), set()
    words = set(re.findall(r"\w+", source))  # a method named is a whole word of the source
    for service in services:
        for op in session.get_service_model(service).operation_names:
            if xform_name(op) in words:
                found.add(f"{service}:{op}")
        try:
            waiters = session.get_waiter_model(service)
        except botocore.exceptions.UnknownServiceError:  # a service with no waiters (sts)
            continue
        for name in waiters.waiter_names:
            if re.search(rf"[\"']{xform_name(name)}[\"']", source):
                found.add(f"{service}:{waiters.get_waiter(name).operation}")
    return frozenset(found)


def recorded_requests(tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """gpuctl's create, reuse, launch and release code run against a stubbed EC2; what it sent."""
    import boto3
    from botocore.stub import Stubber

    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="y")
    sent: list[tuple[str, dict[str, Any]]] = []
    ec2.meta.events.register("provide-client-params.ec2.*",
                             lambda params, model, **_: sent.append((f"ec2:{model.name}", dict(params))))
    aws = SimpleNamespace(ec2=lambda region=None: ec2, region=REGION, clock=FakeClock())
    stub = Stubber(ec2)
    ok = lambda op, answer=None: stub.add_response(op, answer or {})  # noqa: E731
    world_open = [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
    with stub:
        ok("describe_key_pairs", {"KeyPairs": []})
        ok("import_key_pair", {"KeyName": KEY})
        access.ensure_key_pair(aws, tmp_path, CLUSTER, OWNER)
        ok("describe_key_pairs", {"KeyPairs": [{"KeyName": KEY}]})  # the private half is lost
        ok("delete_key_pair")
        ok("import_key_pair", {"KeyName": KEY})
        access.ensure_key_pair(aws, tmp_path / "elsewhere", CLUSTER, OWNER)
        ok("describe_security_groups", {"SecurityGroups": []})
        ok("create_security_group", {"GroupId": "sg-1"})
        ok("authorize_security_group_ingress")
        access.ensure_security_group(aws, "vpc-1", CLUSTER, OWNER, "203.0.113.5/32")
        ok("describe_security_groups", {"SecurityGroups": [{"GroupId": "sg-1", "IpPermissions": world_open}]})
        ok("revoke_security_group_ingress")
        ok("authorize_security_group_ingress")
        access.ensure_security_group(aws, "vpc-1", CLUSTER, OWNER, "203.0.113.5/32")
        for market in ("spot", "on-demand"):
            ok("run_instances", {"Instances": [{"InstanceId": "i-1"}]})
            nodes.launch_nodes(aws, plan(market), lambda _: None)
        # Two nodes in a placement group: node 1 finds no room, node 0 is ended, no zone is left.
        ok("describe_placement_groups", {"PlacementGroups": []})
        ok("create_placement_group")
        group = nodes.ensure_placement_group(aws, CLUSTER, OWNER)
        ok("run_instances", {"Instances": [{"InstanceId": "i-1"}]})
        stub.add_client_error("run_instances", "InsufficientInstanceCapacity", "no room")
        ok("terminate_instances")
        ok("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {"Name": "terminated"}}]}]})
        with pytest.raises(NoCapacityError):
            nodes.launch_nodes(aws, plan("spot", nodes=2, placement_group=group), lambda _: None)
        ok("delete_placement_group")
        inventory.delete_when_free(ec2.delete_placement_group, "DeletePlacementGroup", "InvalidPlacementGroup.InUse",
                                   "InvalidPlacementGroup.Unknown", GroupName=group)
        ok("terminate_instances")
        ok("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {"Name": "terminated"}}]}]})
        ok("delete_security_group")
        ok("delete_key_pair")
        ctx = SimpleNamespace(aws=lambda region=None: aws, spec=SimpleNamespace(wait_timeout_s=5), home=tmp_path)
        inventory.release(ctx, [Resource(provider="aws", kind=k, id=i, region=REGION, cluster=CLUSTER)
                                     for k, i in (("instance", "i-1"), ("security-group", "sg-1"), ("key-pair", KEY))],
                          lambda _: None)
        _bake_and_remove(ok, aws, tmp_path)
        _volumes(ok, aws, tmp_path)
        ok("run_instances", {"Instances": [{"InstanceId": "i-1"}]})
        nodes.launch_nodes(aws, plan("spot", instance_profile=PROFILE), lambda _: None)
        stub.assert_no_pending_responses()
    return sent + _checkpoint_requests(tmp_path) + _bill_requests(tmp_path / "bill")


def _checkpoint_requests(home: Path) -> list[tuple[str, dict[str, Any]]]:
    """The checkpoint store's calls (the bucket, the cluster's role and profile, a run's files,
    `cost`'s usage, `down`'s release of the profile), as gpuctl sends them."""
    import boto3
    from botocore.stub import Stubber

    clients = {name: boto3.client(name, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="y")
               for name in ("iam", "s3", "sts")}
    sent: list[tuple[str, dict[str, Any]]] = []
    for name, client in clients.items():
        client.meta.events.register(f"provide-client-params.{name}.*",
                                    lambda params, model, name=name, **_: sent.append((f"{name}:{model.name}", dict(params))))
    session = SimpleNamespace(get_partition_for_region=lambda region: "aws", client=lambda name, **_: clients[name])
    aws = SimpleNamespace(region=REGION, session=session, client=lambda name, region=None: clients[name])
    ctx = SimpleNamespace(aws=lambda region=None: aws, owner=OWNER, home=home,
                               spec=SimpleNamespace(region=REGION, checkpoint_expiry_days=30, checkpoint_versions_days=3,
                                                    wait_timeout_s=5))
    stubs = {name: Stubber(client) for name, client in clients.items()}
    iam, s3, sts = stubs["iam"], stubs["s3"], stubs["sts"]
    profile = {"InstanceProfile": {"Path": store_iam.owner_path(OWNER), "InstanceProfileName": PROFILE, "InstanceProfileId": "AIPA1234567890ABCDEF",
                                   "Arn": iam_arn("instance-profile", PROFILE), "CreateDate": "2026-11-30T00:00:00Z",
                                   "Roles": [], "Tags": access.tags(CLUSTER, OWNER)}}
    role = {"Path": store_iam.owner_path(OWNER), "RoleName": PROFILE, "RoleId": "AROA1234567890ABCDEF", "Arn": iam_arn("role", PROFILE),
            "CreateDate": "2026-11-30T00:00:00Z"}
    objects = {"Contents": [{"Key": f"clusters/{CLUSTER}/runs/r1/ckpt.index", "Size": 10},
                            {"Key": f"clusters/{CLUSTER}/runs/r1/../escape", "Size": 1}]}
    for stub in stubs.values():
        stub.activate()
    try:
        sts.add_response("get_caller_identity", {"Account": ACCOUNT})
        iam.add_response("get_policy", {"Policy": {"Arn": f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}"}})
        iam.add_response("create_role", {"Role": role})
        iam.add_response("put_role_policy", {})
        iam.add_response("create_instance_profile", profile)
        iam.add_response("get_instance_profile", profile)
        iam.add_response("add_role_to_instance_profile", {})
        s3.add_client_error("head_bucket", service_error_code="404", http_status_code=404)
        for op in ("create_bucket", "put_bucket_encryption", "put_public_access_block", "put_bucket_policy",
                   "put_bucket_versioning", "put_bucket_lifecycle_configuration", "put_bucket_tagging"):
            s3.add_response(op, {})
        store = S3Store(ctx)
        store.prepare(CLUSTER, f"{CLUSTER}.0123456789ab", lambda _: None)
        # `train --data s3://...`: the cluster's role may read exactly that data set from now on.
        iam.add_response("put_role_policy", {})
        assert store_iam.grant_data(aws, OWNER, CLUSTER, REGION, "team-datasets", "cifar10/", "aws") is None
        s3.add_response("list_objects_v2", objects)
        assert store.files(CLUSTER, "r1") == [("ckpt.index", 10)]
        s3.add_response("list_objects_v2", objects)
        s3.add_response("copy_object", {})
        assert store.copy(CLUSTER, "second", "r1") == 1
        s3.add_response("list_objects_v2", objects)
        s3.add_response("delete_objects", {})
        assert store.remove(CLUSTER, "r1") == 2
        s3.add_response("list_objects_v2", objects)
        assert store.usage() == {(CLUSTER, "r1"): 10}
        _snapshots(s3, store, home)
        iam.add_response("list_instance_profiles", {"InstanceProfiles": [profile["InstanceProfile"]]})
        iam.add_response("get_instance_profile", profile)
        iam.add_response("list_roles", {"Roles": [role]})
        assert [p["name"] for p in store_iam.discover(aws, OWNER, CLUSTER, None)] == [PROFILE]
        iam.add_response("get_instance_profile", {"InstanceProfile": {**profile["InstanceProfile"], "Roles": [role]}})
        iam.add_response("remove_role_from_instance_profile", {})
        iam.add_response("delete_instance_profile", {})
        iam.add_response("list_role_policies", {"PolicyNames": [store_iam.POLICY_NAME]})
        iam.add_response("delete_role_policy", {})
        iam.add_response("delete_role", {})
        release = SimpleNamespace(aws=lambda region=None: SimpleNamespace(**vars(aws), ec2=lambda region=None: None),
                                  spec=ctx.spec, home=home)
        inventory.release(release, [Resource(provider="aws", kind="instance-profile", id=PROFILE, region=REGION,
                                             cluster=CLUSTER)], lambda _: None)
        for stub in stubs.values():
            stub.assert_no_pending_responses()
    finally:
        for stub in stubs.values():
            stub.deactivate()
    return sent


def _bill_requests(home: Path) -> list[tuple[str, dict[str, Any]]]:
    """`aws billing setup`, `cost --billed`, and `aws budget set` (first and again), the stop
    action kept current (made, changed, deleted), `lift` and `rm`, as gpuctl sends them."""
    import boto3
    from botocore.stub import Stubber

    from gpuctl.provision.aws.billing import AwsCostExplorer

    clients = {name: boto3.client(name, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="y")
               for name in ("ce", "budgets", "iam", "sts", "ec2")}
    sent: list[tuple[str, dict[str, Any]]] = []
    for name, client in clients.items():
        client.meta.events.register(f"provide-client-params.{name}.*",
                                    lambda params, model, name=name, **_: sent.append((f"{name}:{model.name}", dict(params))))
    aws = SimpleNamespace(region=REGION, client=lambda name, region=None: clients[name],
                          ec2=lambda region=None: clients["ec2"])
    stubs = {name: Stubber(client) for name, client in clients.items()}
    ce, bud, iam, sts, ec2 = (stubs[n] for n in ("ce", "budgets", "iam", "sts", "ec2"))
    role_arn = iam_arn("role", aws_budget.ROLE)
    email = [{"SubscriptionType": "EMAIL", "Address": "me@example.com"}]
    budget = {"Budget": {"BudgetName": aws_budget.NAME, "BudgetLimit": {"Amount": "50.00", "Unit": "USD"},
                         "TimeUnit": "MONTHLY", "BudgetType": "COST"}}

    def action(kind: str, ids: tuple[str, ...] = (), status: str = "STANDBY") -> dict[str, Any]:
        definition = ({"SsmActionDefinition": {"ActionSubType": "STOP_EC2_INSTANCES", "Region": REGION,
                                               "InstanceIds": list(ids)}} if kind == "stop" else
                      {"IamActionDefinition": {"PolicyArn": iam_arn("policy", aws_budget.DENY), "Users": ["alice"]}})
        return {"ActionId": (kind[0] * 36), "BudgetName": aws_budget.NAME, "NotificationType": "ACTUAL",
                "ActionType": "RUN_SSM_DOCUMENTS" if kind == "stop" else "APPLY_IAM_POLICY",
                "ActionThreshold": aws_budget.THRESHOLD, "Definition": definition, "ExecutionRoleArn": role_arn,
                "ApprovalModel": "AUTOMATIC", "Status": status, "Subscribers": email}

    def actions(*listed: dict[str, Any]) -> None:
        bud.add_response("describe_budget_actions_for_budget", {"Actions": list(listed)})

    def running(*ids: str) -> None:
        ec2.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": i} for i in ids]}]})

    made = {"AccountId": ACCOUNT, "BudgetName": aws_budget.NAME}
    for stub in stubs.values():
        stub.activate()
    try:
        explorer = AwsCostExplorer.__new__(AwsCostExplorer)
        explorer.aws, explorer.requests = aws, 0  # type: ignore[assignment]
        ce.add_response("list_cost_allocation_tags", {"CostAllocationTags": [
            {"TagKey": "gpuctl:cluster", "Type": "UserDefined", "Status": "Inactive"}]})
        ce.add_response("update_cost_allocation_tags_status", {"Errors": []})
        ce.add_response("get_cost_and_usage", {"ResultsByTime": []})
        explorer.tag_states(("gpuctl:cluster",))
        explorer.activate(("gpuctl:cluster",))
        explorer.daily("2026-11-01", "2026-11-02")

        budgets = aws_budget.AwsBudgets.__new__(aws_budget.AwsBudgets)
        budgets.home, budgets.profile, budgets.aws, budgets.region, budgets._who = home, "", aws, REGION, {}  # type: ignore[assignment]
        sts.add_response("get_caller_identity", {"Account": ACCOUNT, "Arn": f"arn:aws:iam::{ACCOUNT}:user/alice"})
        bud.add_client_error("describe_budget", "NotFoundException", "no such budget")
        bud.add_response("create_budget", {})
        iam.add_response("create_role", {"Role": {"Path": aws_budget.IAM_PATH, "RoleName": aws_budget.ROLE,
                                                  "RoleId": "AROA1234567890ABCDEF", "Arn": role_arn,
                                                  "CreateDate": "2026-11-30T00:00:00Z"}})
        iam.add_response("put_role_policy", {})
        iam.add_response("create_policy", {"Policy": {"Arn": iam_arn("policy", aws_budget.DENY)}})
        actions()
        bud.add_response("create_budget_action", {**made, "ActionId": "d" * 36})
        running("i-1")  # the stop action, made with what runs
        actions(action("deny"))
        bud.add_response("create_budget_action", {**made, "ActionId": "s" * 36})
        bud.add_response("describe_budget", budget)
        actions(action("deny"), action("stop", ("i-1",)))
        budgets.set(50.0, "me@example.com")
        running("i-2")  # a replacement
        actions(action("deny"), action("stop", ("i-1",)))
        bud.add_response("update_budget_action", {**made, "OldAction": action("stop", ("i-1",)),
                                                  "NewAction": action("stop", ("i-2",))})
        assert budgets.sync(lambda _: None)
        running()  # down
        actions(action("deny"), action("stop", ("i-2",)))
        bud.add_response("delete_budget_action", {**made, "Action": action("stop", ("i-2",))})
        assert budgets.sync(lambda _: None)
        bud.add_response("describe_budget", budget)  # set again: an update
        bud.add_response("update_budget", {})
        iam.add_client_error("create_role", "EntityAlreadyExists", "exists")
        iam.add_client_error("create_policy", "EntityAlreadyExists", "exists")
        actions(action("deny"))
        running()
        actions(action("deny"))
        bud.add_response("describe_budget", budget)
        actions(action("deny"))
        budgets.set(80.0, None)
        actions(action("deny", status="EXECUTION_SUCCESS"))  # lift
        bud.add_response("execute_budget_action", {**made, "ActionId": "d" * 36, "ExecutionType": "REVERSE_BUDGET_ACTION"})
        bud.add_response("describe_budget", budget)
        actions(action("deny", status="REVERSE_SUCCESS"))
        budgets.lift()
        bud.add_response("describe_budget", budget)  # rm
        actions(action("deny", status="REVERSE_SUCCESS"))
        bud.add_response("describe_budget", budget)
        actions(action("deny", status="REVERSE_SUCCESS"))
        actions(action("deny", status="REVERSE_SUCCESS"))
        bud.add_response("delete_budget_action", {**made, "Action": action("deny")})
        bud.add_response("delete_budget", {})
        iam.add_response("delete_role_policy", {})
        iam.add_response("delete_role", {})
        iam.add_response("delete_policy", {})
        assert budgets.remove().removed
        for stub in stubs.values():
            stub.assert_no_pending_responses()
    finally:
        for stub in stubs.values():
            stub.deactivate()
    return sent


def _snapshots(s3: Any, store: S3Store, home: Path) -> None:
    """`data push` (a file in one PUT, a bigger one in parts, a file gone removed), an upload
    that fails and is aborted, and `data rm`, as gpuctl sends them."""
    from boto3.s3.transfer import TransferConfig

    from gpuctl.errors import GpuctlError
    from gpuctl.provision.aws.snapshots import S3Snapshots, _Bucket

    src = home / "snapshot"
    src.mkdir()
    (src / "big.bin").write_bytes(b"b" * (6 << 20))
    (src / "small.txt").write_bytes(b"s")
    config = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, use_threads=False)
    snaps = S3Snapshots(store.ctx)
    snaps.store, snaps.transfer = store, config
    s3.add_response("list_objects_v2", {"Contents": [{"Key": "data/cifar/gone.txt", "Size": 1, "ETag": '"g"'}]})
    s3.add_response("create_multipart_upload", {"UploadId": "u1"})
    s3.add_response("upload_part", {"ETag": '"p1"'})
    s3.add_response("upload_part", {"ETag": '"p2"'})
    s3.add_response("complete_multipart_upload", {})
    s3.add_response("put_object", {"ETag": '"s"'})
    s3.add_response("delete_object", {})
    s3.add_response("list_objects_v2", {"Contents": [{"Key": "data/cifar/big.bin", "Size": 6 << 20, "ETag": '"b-2"'},
                                                     {"Key": "data/cifar/small.txt", "Size": 1, "ETag": '"s"'}]})
    summary = snaps.push("cifar", src, home / "manifests" / "cifar.json", lambda _: None, lambda: None)
    assert (summary["uploaded"], summary["deleted"]) == (2, 1)
    s3.add_response("create_multipart_upload", {"UploadId": "u2"})
    s3.add_client_error("upload_part", "InternalError", "no", http_status_code=500)
    s3.add_response("abort_multipart_upload", {})
    with pytest.raises(GpuctlError):
        _Bucket(store, TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, use_threads=False,
                                      num_download_attempts=1)).upload(str(src / "big.bin"), "data/cifar/big.bin")
    s3.add_response("list_objects_v2", {"Contents": [{"Key": "data/cifar/big.bin", "Size": 1}]})
    s3.add_response("delete_objects", {})
    assert snaps.remove("cifar") == 1


def _bake_and_remove(ok: Callable[..., None], aws: Any, home: Path) -> None:
    """`image bake`'s capture and `image rm`, as gpuctl sends them."""
    from gpuctl.model.images import BakeContents
    from gpuctl.model.records import InstanceRecord

    tagged = [{"Key": k, "Value": v} for k, v in IMAGE_TAGS.items()]
    image = {"ImageId": AMI, "State": "available", "Tags": tagged, "CreationDate": "2026-11-30T00:00:00.000Z",
             "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"SnapshotId": "snap-1", "VolumeSize": 100}}]}
    store = AwsImages(SimpleNamespace(aws=lambda region=None: aws, owner=OWNER, home=home, spec=SimpleNamespace(
        region=REGION, name=CLUSTER, wait_timeout_s=5, base_os="ubuntu-22.04", disk_gb=100)))
    ok("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1"}]}]})  # on-demand: stopped first
    ok("stop_instances")
    ok("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {"Name": "stopped"}}]}]})
    ok("create_image", {"ImageId": AMI})
    ok("describe_images", {"Images": [image]})  # the waiter
    ok("describe_images", {"Images": [image]})
    ok("describe_snapshots", {"Snapshots": [{"SnapshotId": "snap-1", "VolumeSize": 100}]})
    instance = InstanceRecord(id="i-1", cluster=CLUSTER, state="running", launched_at=0.0, workdir="/w")
    store.capture(instance, BakeContents(tensorflow="2.21", installed="2.21.0", variant="cuda", base_image="ami-0base"),
                  lambda _: None, lambda _: None)
    ok("describe_images", {"Images": [image]})
    ok("describe_snapshots", {"Snapshots": [{"SnapshotId": "snap-1", "VolumeSize": 100}]})
    ok("deregister_image")
    ok("delete_snapshot")
    store.remove(AMI, lambda _: None)


def _volumes(ok: Callable[..., None], aws: Any, home: Path) -> None:
    """`volume create`, `volume ls`, `up --volume`'s attach and `volume rm`, as gpuctl sends them."""
    from gpuctl.model.volumes import VolumeUse

    store = aws_volumes.AwsVolumes(SimpleNamespace(aws=lambda region=None: aws, owner=OWNER, home=home, spec=SimpleNamespace(
        region=REGION, wait_timeout_s=5, zones=(), instance_type="g5.xlarge", market="spot")))
    described = {"VolumeId": "vol-1", "Size": 10, "AvailabilityZone": "us-east-1a", "State": "available",
                 "Tags": [{"Key": k, "Value": v} for k, v in VOLUME_TAGS.items()]}
    ok("create_volume", {**described, "State": "creating"})
    ok("describe_volumes", {"Volumes": [described]})  # the waiter
    ok("describe_volumes", {"Volumes": [described]})
    made = store.create("data", 10, "us-east-1a", lambda _: None)
    ok("describe_volumes", {"Volumes": [described]})
    assert [v.name for v in store.volumes()] == ["data"]
    ok("describe_volumes", {"Volumes": [described]})
    ok("attach_volume")
    ok("describe_volumes", {"Volumes": [{**described, "State": "in-use"}]})  # the waiter
    store.attach(VolumeUse(name="data", id="vol-1", path="/mnt/gpuctl/data", zone="us-east-1a"), "i-1", lambda _: None)
    ok("describe_volumes", {"Volumes": [described]})
    ok("delete_volume")
    store.remove(made, lambda _: None)


def plan(market: str, instance_profile: str = "", nodes: int = 1, placement_group: str = "") -> LaunchPlan:
    return LaunchPlan(cluster=CLUSTER, owner=OWNER, instance_type="g5.xlarge", image_id="ami-1", root_device="/dev/sda1",
                      key_name=KEY, security_group="sg-1", subnets={"us-east-1a": "subnet-1"}, market=market,
                      max_price=0.0, fallback_on_demand=False, disk_gb=100, user_data="#!/bin/bash", token_seed="t",
                      instance_profile=instance_profile, nodes=nodes, placement_group=placement_group, wait_timeout_s=5)


def _launch(**changes: Any) -> dict[str, Any]:
    from gpuctl.provision.aws.launch import run_params

    return {**run_params(plan("spot"), "us-east-1a", "spot"), **changes}


# --- the tests --------------------------------------------------------------------------------


def test_every_call_in_the_code_has_a_request_model():
    found = calls_in_code()
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:RevokeSecurityGroupIngress",
            "pricing:GetProducts"} <= found  # the scan itself works
    missing = found - set(REQUESTS)
    assert not missing, f"gpuctl calls {sorted(missing)}: add them to REQUESTS here and to docs/aws-iam.md"


def test_every_call_gpuctl_makes_is_allowed(tmp_path):
    pol, sent, found = policy(), recorded_requests(tmp_path), calls_in_code()
    looks = {op for op in found if op.split(":")[1].startswith(("Describe", "Get", "List", "Head"))}
    assert found - looks <= {op for op, _ in sent}, "a call that changes something is not exercised here"
    for op, params in sent + [(op, {}) for op in sorted(looks)]:
        checks = REQUESTS[op](params)
        assert not refused(pol, checks), f"{op} refused: {refused(pol, checks)}"


@pytest.mark.parametrize("what, op, params", [
    ("terminate an instance without gpuctl's tag", "ec2:TerminateInstances", {"InstanceIds": ["i-foreign"]}),
    ("terminate one of gpuctl's and a foreign one at once", "ec2:TerminateInstances", {"InstanceIds": ["i-1", "i-foreign"]}),
    ("delete a foreign security group", "ec2:DeleteSecurityGroup", {"GroupId": "sg-foreign"}),
    ("open a foreign security group", "ec2:AuthorizeSecurityGroupIngress", {"GroupId": "sg-foreign"}),
    ("close a foreign security group", "ec2:RevokeSecurityGroupIngress", {"GroupId": "sg-foreign"}),
    ("delete a foreign key pair", "ec2:DeleteKeyPair", {"KeyName": "prod-key"}),
    ("put gpuctl's tag on an existing foreign instance", "ec2:CreateTags",
     {"Resources": ["i-foreign"], "Tags": access.tags(CLUSTER, OWNER)}),
    ("launch without IMDSv2 required", "ec2:RunInstances", _launch(MetadataOptions={"HttpTokens": "optional"})),
    ("launch with no metadata options (IMDSv1 allowed)", "ec2:RunInstances",
     {k: v for k, v in _launch().items() if k != "MetadataOptions"}),
    ("launch without gpuctl's tags", "ec2:RunInstances", _launch(TagSpecifications=[])),
    ("launch with a foreign tag key", "ec2:RunInstances", _launch(TagSpecifications=[
        {"ResourceType": t, "Tags": access.tags(CLUSTER, OWNER) + [{"Key": "team", "Value": "finance"}]}
        for t in ("instance", "volume")])),
    ("launch into a foreign security group", "ec2:RunInstances",
     _launch(NetworkInterfaces=[{**_launch()["NetworkInterfaces"][0], "Groups": ["sg-foreign"]}])),
    ("launch with an unencrypted volume", "ec2:RunInstances", _launch(BlockDeviceMappings=[
        {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 100, "VolumeType": "gp3", "Encrypted": False}}])),
    ("create a group without gpuctl's tags", "ec2:CreateSecurityGroup", {"VpcId": "vpc-1"}),
    ("create a placement group without gpuctl's tags", "ec2:CreatePlacementGroup", {"GroupName": "pg-1"}),
    ("delete a foreign placement group", "ec2:DeletePlacementGroup", {"GroupName": "pg-foreign"}),
    ("launch into a foreign placement group", "ec2:RunInstances", _launch(Placement={"GroupName": "pg-foreign"})),
    ("launch with a gpuctl-looking tag key gpuctl does not use", "ec2:RunInstances", _launch(TagSpecifications=[
        {"ResourceType": t, "Tags": access.tags(CLUSTER, OWNER) + [{"Key": "gpuctl:rank", "Value": "0"}]}
        for t in ("instance", "volume")])),
    ("stop a foreign instance", "ec2:StopInstances", {"InstanceIds": ["i-foreign"]}),
    ("image a foreign instance", "ec2:CreateImage", {"InstanceId": "i-foreign", "TagSpecifications": [
        {"ResourceType": "image", "Tags": access.tags(CLUSTER, OWNER)}]}),
    ("make an image without gpuctl's tags", "ec2:CreateImage", {"InstanceId": "i-1"}),
    ("deregister a foreign image", "ec2:DeregisterImage", {"ImageId": "ami-foreign"}),
    ("delete a foreign snapshot", "ec2:DeleteSnapshot", {"SnapshotId": "snap-foreign"}),
    ("tag a snapshot with foreign tag keys", "ec2:CreateTags",
     {"Resources": ["snap-1"], "Tags": [{"Key": "team", "Value": "finance"}]}),
    # Tagging a foreign snapshot as gpuctl's would let `image rm`'s DeleteSnapshot reach it.
    ("put gpuctl's tags on an existing foreign snapshot", "ec2:CreateTags",
     {"Resources": ["snap-foreign"], "Tags": [{"Key": k, "Value": v} for k, v in IMAGE_TAGS.items()]}),
    ("make an image whose snapshots are untagged", "ec2:CreateImage", {"InstanceId": "i-1", "TagSpecifications": [
        {"ResourceType": "image", "Tags": [{"Key": k, "Value": v} for k, v in IMAGE_TAGS.items()]}]}),
    ("read a parameter that is not AWS's DLAMI one", "ssm:GetParameter", {"Name": "/prod/db/password"}),
    ("create a role outside gpuctl's path", "iam:CreateRole", {"RoleName": "admin", "Tags": access.tags(CLUSTER, OWNER),
                                                                "PermissionsBoundary": f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}"}),
    ("create a role without the boundary", "iam:CreateRole", {"RoleName": PROFILE, "Tags": access.tags(CLUSTER, OWNER)}),
    ("create a role with another boundary", "iam:CreateRole", {
        "RoleName": PROFILE, "Tags": access.tags(CLUSTER, OWNER),
        "PermissionsBoundary": "arn:aws:iam::aws:policy/AdministratorAccess"}),
    ("put a policy on a foreign role", "iam:PutRolePolicy", {"RoleName": "admin"}),
    # A role at gpuctl's path without the boundary (an administrator's) gets no
    # policy from gpuctl, and the only policy gpuctl reads is the boundary.
    ("put a policy on a role at gpuctl's path that lacks the boundary", "iam:PutRolePolicy",
     {"RoleName": "gpuctl-made-by-hand"}),
    ("read a managed policy other than the boundary", "iam:GetPolicy",
     {"PolicyArn": f"arn:aws:iam::{ACCOUNT}:policy/prod-admin"}),
    ("put a foreign role into gpuctl's profile", "iam:AddRoleToInstanceProfile",
     {"InstanceProfileName": PROFILE, "RoleName": "admin"}),
    ("launch with a foreign instance profile", "ec2:RunInstances", _launch(IamInstanceProfile={"Name": "admin"})),
    ("make a bucket not named gpuctl-", "s3:CreateBucket", {"Bucket": "prod-data"}),
    ("delete objects of a foreign bucket", "s3:DeleteObjects", {"Bucket": "prod-data", "Delete": {"Objects": [{"Key": "x"}]}}),
    ("read a gpuctl bucket outside clusters/", "s3:CopyObject", {
        "CopySource": {"Bucket": BUCKET, "Key": "other/x"}, "Bucket": BUCKET, "Key": "clusters/c/runs/r/x"}),
    ("import a key pair without an owner tag", "ec2:ImportKeyPair", {"KeyName": "k", "TagSpecifications": [
        {"ResourceType": "key-pair", "Tags": [{"Key": "gpuctl:created-by", "Value": "gpuctl"}]}]}),
    ("create an unencrypted volume", "ec2:CreateVolume", {"Encrypted": False, "VolumeType": "gp3", "TagSpecifications": [
        {"ResourceType": "volume", "Tags": aws_volumes.tags("data", OWNER)}]}),
    ("create a volume without gpuctl's tags", "ec2:CreateVolume", {"Encrypted": True, "VolumeType": "gp3"}),
    ("create a volume with no name tag (gpuctl:volume)", "ec2:CreateVolume", {"Encrypted": True, "TagSpecifications": [
        {"ResourceType": "volume", "Tags": access.tags(CLUSTER, OWNER)}]}),
    ("create a volume with a foreign tag key", "ec2:CreateVolume", {"Encrypted": True, "TagSpecifications": [
        {"ResourceType": "volume", "Tags": aws_volumes.tags("data", OWNER) + [{"Key": "team", "Value": "finance"}]}]}),
    ("delete a foreign volume", "ec2:DeleteVolume", {"VolumeId": "vol-foreign"}),
    # gpuctl tags an instance's root volume too: only its named volumes may be deleted or attached.
    ("delete an instance's root volume", "ec2:DeleteVolume", {"VolumeId": "vol-root"}),
    ("attach a foreign volume to gpuctl's instance", "ec2:AttachVolume", {"VolumeId": "vol-foreign", "InstanceId": "i-1"}),
    ("attach gpuctl's volume to a foreign instance", "ec2:AttachVolume", {"VolumeId": "vol-1", "InstanceId": "i-foreign"}),
    ("attach an instance's root volume elsewhere", "ec2:AttachVolume", {"VolumeId": "vol-root", "InstanceId": "i-1"}),
    ("change a budget that is not gpuctl's", "budgets:UpdateBudget", {"NewBudget": {"BudgetName": "finance"}}),
    ("delete a budget that is not gpuctl's", "budgets:DeleteBudget", {"BudgetName": "finance"}),
    ("run another budget's action", "budgets:ExecuteBudgetAction", {"BudgetName": "finance", "ActionId": "a1"}),
    ("give a budget action another role", "budgets:CreateBudgetAction", {
        "BudgetName": aws_budget.NAME, "ExecutionRoleArn": f"arn:aws:iam::{ACCOUNT}:role/admin"}),
    ("put a policy on a role beside the budget's", "iam:PutRolePolicy",
     {"_arn": f"arn:aws:iam::{ACCOUNT}:role/gpuctl-budget/other", "RoleName": "other"}),
    ("make a managed policy other than the deny one", "iam:CreatePolicy", {"PolicyName": "admin-all",
                                                                           "Path": aws_budget.IAM_PATH}),
    ("delete a managed policy other than the deny one", "iam:DeletePolicy",
     {"PolicyArn": f"arn:aws:iam::{ACCOUNT}:policy/prod-admin"}),
])
def test_what_gpuctl_must_not_be_able_to_do_is_denied(what, op, params):
    assert refused(policy(), REQUESTS[op](params)), what


@pytest.mark.parametrize("action, resource", [
    ("ec2:StartInstances", arn("instance", "i-1")),
    # DeleteVolume: with gpuctl's tag but no gpuctl:volume (an instance's root volume) it stays refused.
    ("ec2:ModifyInstanceAttribute", arn("instance", "i-1")), ("ec2:DeleteVolume", arn("volume", "vol-1")),
    ("ec2:DetachVolume", arn("volume", "vol-1")),
    ("ec2:DeleteVpc", arn("vpc", "vpc-1")), ("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/admin"),
    ("s3:DeleteBucket", f"arn:aws:s3:::{BUCKET}"), ("iam:AttachRolePolicy", iam_arn("role", PROFILE)),
    ("iam:DeleteRolePermissionsBoundary", iam_arn("role", PROFILE)), ("iam:CreatePolicyVersion",
                                                                      f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}"),
])
def test_actions_gpuctl_never_calls_are_not_granted_even_on_its_own_resources(action, resource):
    assert decide(policy(), action, resource, {"aws:ResourceTag/gpuctl:created-by": "gpuctl"}) == "implicit deny"


def test_the_evaluator_decides_as_iam_does():
    allow_all = {"Effect": "Allow", "Action": "ec2:*", "Resource": "*"}
    deny = {"Effect": "Deny", "Action": "ec2:Terminate*", "Resource": "arn:aws:ec2:*:*:instance/*",
            "Condition": {"StringNotEquals": {"aws:ResourceTag/x": "y"}}}
    tagged = {"Effect": "Allow", "Action": "ec2:TerminateInstances", "Resource": "arn:aws:ec2:*:*:instance/*",
              "Condition": {"StringEqualsIfExists": {"aws:ResourceTag/x": "y"}, "Null": {"aws:ResourceTag/z": "false"}}}
    assert decide({"Statement": [allow_all]}, "EC2:terminateinstances", arn("instance", "i-1"), {}) == "allow"
    assert decide({"Statement": []}, "ec2:TerminateInstances", arn("instance", "i-1"), {}) == "implicit deny"
    with pytest.raises(AssertionError, match="does not know StringNotEquals"):
        decide({"Statement": [allow_all, deny]}, "ec2:TerminateInstances", arn("instance", "i-1"), {})
    deny["Condition"] = {"Null": {"aws:ResourceTag/x": "true"}}  # explicit deny wins over any allow
    assert decide({"Statement": [allow_all, deny]}, "ec2:TerminateInstances", arn("instance", "i-1"), {}) == "explicit deny"
    assert decide({"Statement": [tagged]}, "ec2:TerminateInstances", arn("instance", "i-1"), {"aws:ResourceTag/z": "1"}) == "allow"
    assert decide({"Statement": [tagged]}, "ec2:TerminateInstances", arn("instance", "i-1"),
                  {"aws:ResourceTag/z": "1", "aws:ResourceTag/x": "n"}) == "implicit deny"
    assert decide({"Statement": [tagged]}, "ec2:TerminateInstances", arn("instance", "i-1"), {}) == "implicit deny"
    # A wildcard never spans ARN segments; an empty account segment (AMIs) matches "*".
    assert not _arn_matches("arn:aws:ec2:*:instance/*", arn("instance", "i-1"))
    assert _arn_matches("arn:aws:ec2:*:*:image/*", arn("image", "ami-1"))
    assert _condition("ForAllValues:StringEquals", "aws:TagKeys", ["a"], {})  # a missing key: true
    assert not _condition("ForAllValues:StringEquals", "aws:TagKeys", ["a"], {"aws:TagKeys": ["a", "b"]})


# --- the per-owner tightening docs/aws-iam.md describes ------------------------------------------

COLLEAGUE = "bob@desk-9f8e7d"


def per_owner(pol: dict[str, Any], owner: str) -> dict[str, Any]:
    """The policy tightened to one install, exactly as docs/aws-iam.md says to."""
    h = store_iam.owner_hash(owner)
    text = (json.dumps(pol).replace("role/gpuctl/*", f"role/gpuctl/{h}/*")
            .replace("instance-profile/gpuctl/*", f"instance-profile/gpuctl/{h}/*")
            .replace("arn:aws:s3:::gpuctl-*", f"arn:aws:s3:::gpuctl-*-{h}"))
    tight = json.loads(text)
    for release in [st for st in tight["Statement"]
                    if st["Sid"] in ("ChangeAndReleaseOnlyGpuctlsOwn", "AttachAndDeleteOnlyGpuctlsNamedVolumes")]:
        release["Condition"]["StringEquals"]["aws:ResourceTag/gpuctl:owner"] = owner
    return tight


def test_the_per_owner_tightening_still_allows_every_call_of_its_owner(tmp_path):
    pol, sent, found = per_owner(policy(), OWNER), recorded_requests(tmp_path), calls_in_code()
    assert json.dumps(pol) != json.dumps(policy())
    looks = {op for op in found if op.split(":")[1].startswith(("Describe", "Get", "List", "Head"))}
    for op, params in sent + [(op, {}) for op in sorted(looks)]:
        checks = REQUESTS[op](params)
        assert not refused(pol, checks), f"{op} refused: {refused(pol, checks)}"


def test_the_per_owner_tightening_keeps_a_colleagues_roles_bucket_and_objects_out():
    """The per-owner tightening covered only the release statement; a colleague's checkpoint objects,
    role policies and roles to pass stayed open."""
    pol = per_owner(policy(), OWNER)
    theirs = store_iam.profile_name(COLLEAGUE, CLUSTER, REGION)
    their_bucket = bucket_name(ACCOUNT, REGION, COLLEAGUE)
    their_role = iam_arn("role", theirs, COLLEAGUE)
    bounded = {"iam:PermissionsBoundary": BOUNDARY_ARN}
    for what, checks in [
        ("pass a colleague's role to EC2", [("iam:PassRole", their_role, {"iam:PassedToService": "ec2.amazonaws.com"})]),
        ("put a policy on a colleague's role", [("iam:PutRolePolicy", their_role, bounded)]),
        ("delete a colleague's role", [("iam:DeleteRole", their_role, bounded)]),
        ("make a role at a colleague's path", [("iam:CreateRole", their_role, {
            **_request_tags({t["Key"]: t["Value"] for t in access.tags(CLUSTER, COLLEAGUE)}), **bounded})]),
        ("delete a colleague's instance profile", [("iam:DeleteInstanceProfile",
                                                    iam_arn("instance-profile", theirs, COLLEAGUE), {})]),
        ("read a colleague's checkpoint", [("s3:GetObject", f"arn:aws:s3:::{their_bucket}/clusters/c/runs/r/x", {})]),
        ("delete a colleague's checkpoint", [("s3:DeleteObject", f"arn:aws:s3:::{their_bucket}/clusters/c/runs/r/x", {})]),
        ("list a colleague's bucket", [("s3:ListBucket", f"arn:aws:s3:::{their_bucket}", {})]),
        ("terminate a colleague's instance", [("ec2:TerminateInstances", arn("instance", "i-bob"), {
            f"aws:ResourceTag/{t['Key']}": t["Value"] for t in access.tags(CLUSTER, COLLEAGUE)})]),
        ("delete a colleague's volume", [("ec2:DeleteVolume", arn("volume", "vol-bob"), {
            f"aws:ResourceTag/{t['Key']}": t["Value"] for t in aws_volumes.tags("data", COLLEAGUE)})]),
    ]:
        assert refused(pol, checks), what
        assert not refused(policy(), checks), f"the untightened policy allows it (so the tightening is what keeps it out): {what}"


BILL_SIDS = ("ReadTheBill", "ActivateGpuctlsCostAllocationTags", "BudgetNamedGpuctlBackstop",
             "BudgetActionRoleAndDenyPolicy", "PassTheBudgetActionRoleToBudgets")


def test_the_bill_and_budget_statements_grant_exactly_their_calls_and_are_optional(tmp_path):
    """Issue 41: `cost --billed`, `aws billing setup` and `aws budget` need exactly the actions of
    their own statements (no more), and everything else gpuctl does works without them."""
    pol = policy()
    ours = [st for st in pol["Statement"] if st["Sid"] in BILL_SIDS]
    assert sorted(st["Sid"] for st in ours) == sorted(BILL_SIDS)
    needed = {c[0] for op, params in _bill_requests(tmp_path / "bill") for c in REQUESTS[op](params)}
    granted = {a for st in ours for a in _listed(st["Action"])}
    assert granted == needed - {"ec2:DescribeInstances"}  # that one is LookAnywhere's
    without = {**pol, "Statement": [st for st in pol["Statement"] if st["Sid"] not in BILL_SIDS]}
    for op, params in recorded_requests(tmp_path)[:-len(_bill_requests(tmp_path / "again"))]:
        assert not refused(without, REQUESTS[op](params)), f"{op} needs a billing statement"
