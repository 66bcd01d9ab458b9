"""A cluster's instance profile: an IAM role that EC2 may assume, allowed nothing but its own
cluster's prefix of the checkpoint bucket, and the instance profile that hands the role to the
instance. The instance's credentials then come from its metadata service, rotate by themselves and
never exist on the user's machine: nothing secret travels in user data or over SSH.

Role and profile share one name (owner, cluster and region; see `profile_name`) and live under
the IAM path /gpuctl/, which is how `discover` lists them cheaply. Both carry gpuctl's tags and
the region (IAM is global, the cluster is not). `down` deletes them; the bucket stays.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

from gpuctl.errors import CloudError, GpuctlError
from gpuctl.provision.aws import access
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, error_message, translate

PATH = "/gpuctl/"  # every gpuctl role and profile is below it; each owner's under PATH + owner_hash + "/"
TAG_REGION = "gpuctl:region"
POLICY_NAME = "gpuctl-checkpoints"
MAX_NAME = 64  # IAM role names: 64 characters (instance profiles allow 128; one name serves both)
NO_IAM_HINT = ('Set `aws.checkpoints = "instance"` (checkpoints then stay on the instance\'s disk and go with it), '
               "or grant the IAM and S3 permissions listed in docs/aws-iam.md.")
NO_BOUNDARY_HINT = ("An administrator makes it once (the `aws iam create-policy` line in docs/aws-iam.md), or set "
                    '`aws.checkpoints = "instance"` (checkpoints then stay on the instance\'s disk and go with it).')
DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation")


def owner_hash(owner: str) -> str:
    """8 hex characters naming an owner (a gpuctl install) in ARNs: the end of its bucket's name
    and its IAM path, so an administrator can keep colleagues apart in IAM (docs/aws-iam.md)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:8]


def owner_path(owner: str) -> str:
    return f"{PATH}{owner_hash(owner)}/"


def profile_name(owner: str, cluster: str, region: str) -> str:
    """`gpuctl-<cluster>-<region>-<hash>`: readable in the console, unique per owner, cluster and
    region (the hash covers all three, so shortening a long cluster name loses nothing; IAM names
    ignore case, the hash does not)."""
    digest = hashlib.sha256(f"{owner}|{cluster}|{region}".encode()).hexdigest()[:10]
    head = f"gpuctl-{cluster}-{region}"
    room = MAX_NAME - len(digest) - 1
    if len(head) > room:
        head = head[:room].rstrip("-_")
    return f"{head}-{digest}"


BOUNDARY = "gpuctl-checkpoint-boundary"  # a managed policy an administrator may make (docs/aws-iam.md)


def boundary_arn(aws: Aws, account: str, partition: str = "aws") -> str:
    """The permissions boundary every cluster role gets; refused (CloudError) where the account has
    none, or gpuctl may not look at it, so no role is ever made without it.

    An identity allowed to create roles and put inline policies on them could grant such a role
    anything and pass it to an instance of its own; a boundary an administrator made (and gpuctl may
    not change) caps every gpuctl role at the checkpoint buckets whatever its inline policy says.
    docs/aws-iam.md's policy requires it on CreateRole and PutRolePolicy."""
    arn = f"arn:{partition}:iam::{account}:policy/{BOUNDARY}"
    try:
        aws.client("iam").get_policy(PolicyArn=arn)
    except aws_errors() as exc:
        code = error_code(exc)
        if code == "NoSuchEntity":
            raise CloudError(f"the permissions boundary {BOUNDARY} does not exist in account {account}: gpuctl makes "
                             "no checkpoint role without it", NO_BOUNDARY_HINT) from exc
        if code in DENIED:
            raise CloudError(f"not allowed to call iam:GetPolicy on {arn}, needed to put the permissions boundary on "
                             "the checkpoint role", NO_BOUNDARY_HINT) from exc
        raise translate(exc, "GetPolicy") from exc
    return arn


def trust_policy() -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def access_policy(bucket: str, place: str, partition: str = "aws") -> dict[str, Any]:
    """Read, write and delete the cluster's own objects, and list its own prefix: nothing else of
    the bucket (another cluster's runs, an earlier cluster's of the same name), nothing else in the
    account. `place`: the cluster's ClusterSpec.store_place."""
    prefix = f"clusters/{place}/"
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "ClusterObjects", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
         "Resource": f"arn:{partition}:s3:::{bucket}/{prefix}*"},
        {"Sid": "ListClusterPrefix", "Effect": "Allow", "Action": "s3:ListBucket",
         "Resource": f"arn:{partition}:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}}},
    ]}


DATA_POLICY_NAME = "gpuctl-data"


def data_policy(bucket: str, prefix: str, partition: str = "aws") -> dict[str, Any]:
    """Read the objects of one data set (`prefix`: "" or a folder ending in "/"): nothing else,
    no listing (the listing is made on the user's machine and handed to the instance)."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "ReadTheDataSet", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": f"arn:{partition}:s3:::{bucket}/{prefix}*"}]}


def grant_data(aws: Aws, owner: str, cluster: str, region: str, bucket: str, prefix: str,
               partition: str = "aws") -> str | None:
    """The cluster's role may read exactly this data set from now on (its `gpuctl-data` policy is
    set to it: the train being started is the one that fetches); why not, or None. Under the
    permissions boundary, which must allow the bucket too (docs/aws-iam.md)."""
    name = profile_name(owner, cluster, region)
    try:
        aws.client("iam").put_role_policy(RoleName=name, PolicyName=DATA_POLICY_NAME,
                                          PolicyDocument=json.dumps(data_policy(bucket, prefix, partition)))
    except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
        code = error_code(exc)
        if code == "NoSuchEntity":
            return f"the cluster has no role {name}"
        if code in DENIED:
            return "not allowed to call iam:PutRolePolicy on its role"
        raise translate(exc, "PutRolePolicy") from exc
    return None


def _tags(cluster: str, owner: str, region: str) -> list[dict[str, str]]:
    return access.tags(cluster, owner) + [{"Key": TAG_REGION, "Value": region}]


def denied(exc: GpuctlError, what: str, service: str = "iam") -> GpuctlError:
    """A refusal for lack of permission, said as what it stops (`what`) with the way around it;
    any other error as it was."""
    import re

    cause = exc.__cause__
    if cause is None or error_code(cause) not in DENIED:
        return exc
    m = re.search(r"perform: ([a-z0-9-]+:[A-Za-z0-9]+)", error_message(cause))
    perm = m.group(1) if m else f"{service}:{exc.message.rsplit(':', 1)[-1]}" if ":" in exc.message else service
    return CloudError(f"not allowed to call {perm}, needed for {what}", NO_IAM_HINT)


def ensure_profile(aws: Aws, owner: str, cluster: str, region: str, bucket: str, partition: str = "aws",
                   progress: Callable[[str], None] | None = None, *, boundary: str, place: str = "") -> str:
    """The cluster's role and instance profile, made or found and set to exactly the prefix policy
    of its place in the store (`place`, ClusterSpec.store_place; default its name); their name.
    Whatever this call made is deleted again if a later step fails (no permission for
    IAM, say), so a refused `up` leaves nothing behind."""

    iam = aws.client("iam")
    name = profile_name(owner, cluster, region)
    tags = _tags(cluster, owner, region)
    made = False
    try:
        try:
            iam.create_role(RoleName=name, Path=owner_path(owner), AssumeRolePolicyDocument=json.dumps(trust_policy()),
                            Description=f"gpuctl cluster {cluster} ({region}): its checkpoints in {bucket}",
                            MaxSessionDuration=3600, Tags=tags, PermissionsBoundary=boundary)
            made = True
        except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
            if error_code(exc) != "EntityAlreadyExists":
                raise translate(exc, "CreateRole") from exc
            _check_owner(call(iam.list_role_tags, RoleName=name).get("Tags", []), owner, f"role {name}")
        call(iam.put_role_policy, RoleName=name, PolicyName=POLICY_NAME,
             PolicyDocument=json.dumps(access_policy(bucket, place or cluster, partition)))
        try:
            iam.create_instance_profile(InstanceProfileName=name, Path=owner_path(owner), Tags=tags)
            made = True
        except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
            if error_code(exc) != "EntityAlreadyExists":
                raise translate(exc, "CreateInstanceProfile") from exc
        roles = call(iam.get_instance_profile, InstanceProfileName=name)["InstanceProfile"].get("Roles", [])
        for role in roles:
            if role["RoleName"] != name:  # a profile holds one role: only ever its own
                call(iam.remove_role_from_instance_profile, InstanceProfileName=name, RoleName=role["RoleName"])
        if not any(r["RoleName"] == name for r in roles):
            call(iam.add_role_to_instance_profile, InstanceProfileName=name, RoleName=name)
    except GpuctlError as exc:
        if made:
            try:
                delete_profile(aws, name)
            except GpuctlError:
                pass  # `down` finds it by its path and tags
        raise denied(exc, f"the checkpoint role of cluster {cluster!r}") from exc.__cause__
    if progress:
        progress(f"instance profile {name}: its checkpoints in s3://{bucket}/clusters/{place or cluster}/ only")
    return name


def _check_owner(tags: list[dict[str, str]], owner: str, what: str) -> None:
    found = {t["Key"]: t["Value"] for t in tags}
    if found.get(access.TAG_CREATED_BY) != "gpuctl" or found.get(access.TAG_OWNER) != owner:
        raise CloudError(f"{what} exists but is not this gpuctl install's (owner {found.get(access.TAG_OWNER, '?')})",
                         "Pick another cluster name (--name), or delete that role in the IAM console.")


def delete_profile(aws: Aws, name: str) -> None:
    """Take the role out of the profile, delete its inline policies, the profile and the role;
    what is gone already is fine (a killed `up` may have made only some of them)."""

    iam = aws.client("iam")

    def gone(fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
            if error_code(exc) == "NoSuchEntity":
                return None
            raise translate(exc, fn.__name__.title().replace("_", "")) from exc

    profile = gone(iam.get_instance_profile, InstanceProfileName=name)
    if profile:
        for role in profile["InstanceProfile"].get("Roles", []):
            gone(iam.remove_role_from_instance_profile, InstanceProfileName=name, RoleName=role["RoleName"])
        gone(iam.delete_instance_profile, InstanceProfileName=name)
    policies = gone(iam.list_role_policies, RoleName=name)
    if policies is not None:
        for policy in policies.get("PolicyNames", []):
            gone(iam.delete_role_policy, RoleName=name, PolicyName=policy)
        gone(iam.delete_role, RoleName=name)


def discover(aws: Aws, owner: str | None, cluster: str | None, region: str | None) -> list[dict[str, Any]]:
    """gpuctl's roles and instance profiles (one name for both) under /gpuctl/, as
    {"name", "tags"}, for this owner (None: any) and cluster and region (None: any). Without the
    permission to list IAM (an install that keeps checkpoints on the instance and was never granted
    IAM), there is nothing gpuctl could have made: an empty list."""

    iam = aws.client("iam")
    found: dict[str, dict[str, str]] = {}
    try:
        for page in iam.get_paginator("list_instance_profiles").paginate(PathPrefix=PATH):
            for p in page.get("InstanceProfiles", []):
                # ListInstanceProfiles leaves the tags out (as every IAM listing does); GetInstanceProfile has them.
                got = iam.get_instance_profile(InstanceProfileName=p["InstanceProfileName"])["InstanceProfile"]
                found[p["InstanceProfileName"]] = {t["Key"]: t["Value"] for t in got.get("Tags", [])}
        # A role whose profile never came (an `up` killed in between) is found too.
        for page in iam.get_paginator("list_roles").paginate(PathPrefix=PATH):
            for r in page.get("Roles", []):
                if r["RoleName"] not in found:
                    tags = iam.list_role_tags(RoleName=r["RoleName"]).get("Tags", [])
                    found[r["RoleName"]] = {t["Key"]: t["Value"] for t in tags}
    except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
        if error_code(exc) in DENIED:
            return []
        raise translate(exc, "ListInstanceProfiles") from exc
    out = []
    for name, tags in sorted(found.items()):
        if tags.get(access.TAG_CREATED_BY) != "gpuctl":
            continue
        if owner is not None and tags.get(access.TAG_OWNER) != owner:
            continue
        if cluster and tags.get(access.TAG_CLUSTER) != cluster:
            continue
        if region and tags.get(TAG_REGION) != region:
            continue
        out.append({"name": name, "tags": tags})
    return out
