"""The checkpoint store on AWS: the bucket, the cluster's instance profile, and the payload that
pushes and pulls a run's files from a real sshd test host, all against the moto server over HTTP
(see tests/aws.py; the hosts reach it through their gateway, GPUCTL_TEST_S3_ENDPOINT).

Bad inputs tried: IAM refusing CreateRole (a clear error, nothing left behind), a bucket name
another account holds, `aws.checkpoints = "bogus"`, `aws.checkpoint_expiry_days = -1`, a hostile
key ("../x") in the bucket on pull, `runs rm` of an unknown run and of a running one."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from gpuctl.provision.aws import store_iam
from gpuctl.provision.aws.store import bucket_name
from tests.aws import ACCOUNT, REGION, live_instances, nothing_created

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]
PAYLOAD = Path(__file__).resolve().parents[2] / "gpuctl" / "payloads" / "gpuctl_store.py"


def tag_dict(tags):
    return {t["Key"]: t["Value"] for t in tags}


def owner_of(home: Path) -> str:
    return (home / "owner").read_text().strip()


def clients():
    return boto3.client("s3", region_name=REGION), boto3.client("iam", region_name=REGION)


def gpuctl_roles(iam):
    return iam.list_roles(PathPrefix=store_iam.PATH)["Roles"]


def gpuctl_profiles(iam):
    return iam.list_instance_profiles(PathPrefix=store_iam.PATH)["InstanceProfiles"]


def test_up_makes_a_private_bucket_and_a_profile_for_the_clusters_prefix_only(gpuctl, aws, isolated):
    # The administrator's permissions boundary (docs/aws-iam.md): every gpuctl role gets it.
    boundary = clients()[1].create_policy(PolicyName=store_iam.BOUNDARY, PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject",
                                                "Resource": "arn:aws:s3:::gpuctl-*/clusters/*"}]}))["Policy"]["Arn"]
    res = gpuctl(*UP)
    owner = owner_of(isolated)
    bucket = bucket_name(ACCOUNT, REGION, owner)
    assert f"checkpoints: s3://{bucket}/clusters/default/" in res.stderr
    s3, iam = clients()

    assert s3.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert block == {"BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                     "RestrictPublicBuckets": True}
    tags = tag_dict(s3.get_bucket_tagging(Bucket=bucket)["TagSet"])
    assert tags["gpuctl:created-by"] == "gpuctl" and tags["gpuctl:owner"] == owner
    lifecycle = {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert lifecycle["gpuctl-checkpoint-expiry"]["Expiration"] == {"Days": 30}
    assert lifecycle["gpuctl-checkpoint-expiry"]["Filter"] == {"Prefix": "clusters/"}
    assert lifecycle["gpuctl-abort-incomplete-uploads"]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    assert policy["Statement"][0]["Effect"] == "Deny"
    assert policy["Statement"][0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}

    name = store_iam.profile_name(owner, "default", REGION)
    (role,) = gpuctl_roles(iam)
    assert role["RoleName"] == name and role["Path"] == store_iam.PATH
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert iam.get_role(RoleName=name)["Role"]["PermissionsBoundary"]["PermissionsBoundaryArn"] == boundary
    role_tags = tag_dict(iam.list_role_tags(RoleName=name)["Tags"])
    assert role_tags["gpuctl:cluster"] == "default" and role_tags["gpuctl:owner"] == owner
    assert role_tags["gpuctl:region"] == REGION
    assert iam.list_role_policies(RoleName=name)["PolicyNames"] == [store_iam.POLICY_NAME]
    doc = iam.get_role_policy(RoleName=name, PolicyName=store_iam.POLICY_NAME)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == store_iam.access_policy(bucket, "default")
    assert doc["Statement"][0]["Resource"] == f"arn:aws:s3:::{bucket}/clusters/default/*"
    (profile,) = gpuctl_profiles(iam)
    assert profile["InstanceProfileName"] == name and [r["RoleName"] for r in profile["Roles"]] == [name]
    assert tag_dict(iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Tags"])["gpuctl:owner"] == owner

    (inst,) = live_instances(aws)
    assert inst["IamInstanceProfile"]["Arn"].endswith(f"instance-profile{store_iam.PATH}{name}")

    # The profile is the cluster's: status --all lists it, down removes it; the bucket stays.
    listed = json.loads(gpuctl("status", "--all", "--json").stdout)
    assert any(r["kind"] == "instance-profile" and r["id"] == name for r in listed["resources"])
    s3.put_object(Bucket=bucket, Key="clusters/default/runs/r1/ckpt", Body=b"weights")
    res = gpuctl("down", "-y")
    assert f"deleted instance profile and role {name}" in res.stderr
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == []
    assert s3.get_object(Bucket=bucket, Key="clusters/default/runs/r1/ckpt")["Body"].read() == b"weights"
    nothing_created(aws)
    gpuctl("down", "-y")  # again: nothing left, nothing fails


def test_checkpoints_on_the_instance_make_no_bucket_and_no_role(gpuctl, aws, monkeypatch):
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", "instance")
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_EXPIRY_DAYS", "0")
    gpuctl(*UP)
    s3, iam = clients()
    assert s3.list_buckets()["Buckets"] == []
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == []
    (inst,) = live_instances(aws)
    assert "IamInstanceProfile" not in inst
    gpuctl("down", "-y")


def test_expiry_zero_keeps_checkpoints_until_runs_rm(gpuctl, aws, isolated, monkeypatch):
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_EXPIRY_DAYS", "0")
    res = gpuctl(*UP)
    assert "kept until `gpuctl runs rm`" in res.stderr
    s3, _ = clients()
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket_name(ACCOUNT, REGION, owner_of(isolated)))["Rules"]
    assert [r["ID"] for r in rules] == ["gpuctl-abort-incomplete-uploads"]
    gpuctl("down", "-y")


@pytest.mark.parametrize("key, value, needle", [
    ("CHECKPOINTS", "bogus", "aws.checkpoints"),
    ("CHECKPOINT_EXPIRY_DAYS", "-1", "aws.checkpoint_expiry_days"),
])
def test_bad_checkpoint_settings_are_refused_before_anything_exists(gpuctl, aws, monkeypatch, key, value, needle):
    monkeypatch.setenv(f"GPUCTL_AWS__{key}", value)
    res = gpuctl(*UP, code=3)
    assert needle in res.stderr and "Traceback" not in res.stderr
    nothing_created(aws)
    assert clients()[0].list_buckets()["Buckets"] == []


def test_iam_refused_says_so_and_leaves_nothing(gpuctl, aws, monkeypatch):
    # moto's IAM enforcement checks every call of the test's own credentials as well (the reset,
    # the checks below) and knows no Resource or Condition; refusing CreateRole alone, as an
    # account without IAM permissions does, is done in the backend the server serves from.
    from moto.iam.exceptions import IAMException
    from moto.iam.models import IAMBackend

    class AccessDenied(IAMException):
        code = "AccessDenied"

        def __init__(self):
            super().__init__("User: arn:aws:iam::123456789012:user/dev is not authorized to perform: iam:CreateRole "
                             "on resource: arn:aws:iam::123456789012:role/gpuctl/x")

    def refuse(self, *args, **kwargs):
        raise AccessDenied()

    monkeypatch.setattr(IAMBackend, "create_role", refuse)
    res = gpuctl(*UP, code=9)
    err = res.stderr
    assert "Error: not allowed to call iam:CreateRole, needed for the checkpoint role of cluster 'default'" in err
    assert 'aws.checkpoints = "instance"' in err and "docs/aws-iam.md" in err
    nothing_created(aws)
    s3, iam = clients()
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == [] and s3.list_buckets()["Buckets"] == []
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
