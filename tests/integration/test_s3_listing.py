"""The S3 reader `train --data s3://...` checks and lists a data set with (provision/aws/s3http.py:
gpuctl's own SigV4 over HTTP, each page's XML read as it arrives), against the tests' moto S3 over
HTTP: no boto3 client on that path (issue 38: the CLI's memory at 100,000 objects), every key
whole across pages (control characters, spaces, '+', non-ASCII: encoding-type=url), signatures
moto checks (IAM enforced), a bucket in another region, and the bad inputs' errors. The whole
command's bad inputs are tests/integration/test_s3_data.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuctl.errors import CloudError, DataError
from gpuctl.model.data import parse_s3
from tests.aws import moto_client

KEYS = ["set/plain.bin", "set/sp ace/a+b=c&d.txt", "set/名前/ü~x", "set/ctl\x01\x1f\x7fname", "set/pct%2F%20lit",
        "set/folder/"]


def fill(s3, bucket: str, many: int, region: str = "us-east-1") -> None:
    extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    s3.create_bucket(Bucket=bucket, **extra)
    for key in KEYS:
        s3.put_object(Bucket=bucket, Key=key, Body=b"" if key.endswith("/") else key.encode())
    for i in range(many):
        s3.put_object(Bucket=bucket, Key=f"set/many/{i:05d}", Body=b"x" * (i % 7))


def test_a_listing_over_pages_keeps_every_key_whole_and_loads_no_boto3(aws):
    """In a process of its own: what the reader imports is the point (the CLI's peak RSS). Pages
    of 10 keys (S3's are 1,000: filling moto with thousands took 26 s of the fast tier), so the odd
    keys fall on either side of page boundaries."""
    fill(moto_client("s3"), "pages", 40)  # 46 keys, the folder's among them: five pages of 10
    code = """
import gc, json, sys
from gpuctl.model.data import parse_s3
from gpuctl.provision.aws import s3http
from gpuctl.provision.aws.datasets import S3DataSets
s3http.PAGE_KEYS = 10
pages, read = [], s3http._page
s3http._page = lambda res: pages.append(1) or read(res)
listing = S3DataSets("", "us-east-1").listing(parse_s3("s3://pages/set"))
print(json.dumps({"objects": listing.objects, "region": listing.region, "total": listing.total_bytes, "pages": len(pages),
                  "loaded": sorted(m for m in ("boto3", "s3transfer") if m in sys.modules),
                  "clients": sum(isinstance(o, sys.modules["botocore.client"].BaseClient) for o in gc.get_objects())
                             if "botocore.client" in sys.modules else 0}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["loaded"] == [] and got["clients"] == 0, "the listing made a boto3 client"
    objects = {rel: (size, etag) for rel, size, etag in got["objects"]}
    assert got["pages"] == 5 and len(got["objects"]) == 40 + 5 and "folder/" not in objects
    assert {k[len("set/"):] for k in KEYS if not k.endswith("/")} <= set(objects)
    import hashlib

    assert objects["ctl\x01\x1f\x7fname"] == (len("set/ctl\x01\x1f\x7fname"),
                                              hashlib.md5(b"set/ctl\x01\x1f\x7fname").hexdigest())
    assert got["total"] == sum(s for s, _ in objects.values()) and got["region"] == "us-east-1"


def test_a_bucket_in_another_region_is_listed_there(aws):
    from gpuctl.provision.aws.datasets import S3DataSets

    fill(moto_client("s3"), "far-away", 3, region="eu-west-1")
    listing = S3DataSets("", "us-east-1").listing(parse_s3("s3://far-away/set/many"))
    assert listing.region == "eu-west-1" and [o[0] for o in listing.objects] == ["00000", "00001", "00002"]


def test_moto_checks_the_signatures_of_a_user_allowed_to_read(aws, monkeypatch):
    """IAM enforced (moto then checks every SigV4 signature): a user allowed to read lists it,
    one with a wrong secret is refused as AWS refuses it."""
    from gpuctl.provision.aws.datasets import S3DataSets

    from gpuctl.provision.aws import s3http

    monkeypatch.setattr(s3http, "PAGE_KEYS", 10)  # signed pages after the first: a continuation token in each
    pages, read = [], s3http._page
    monkeypatch.setattr(s3http, "_page", lambda res: pages.append(1) or read(res))
    fill(moto_client("s3"), "signed", 25)
    iam = moto_client("iam")
    iam.create_user(UserName="reader")
    # (moto asks for "s3:HeadBucket" and "s3:ListObjectsV2", which AWS grants with s3:ListBucket)
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject",
                                                                              "s3:HeadBucket", "s3:ListObjectsV2"],
                                                "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    listing = S3DataSets("", "us-east-1").listing(parse_s3("s3://signed/set"))
    assert len(listing.objects) == 25 + 5 and len(pages) == 4
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong" + key["SecretAccessKey"])
    with pytest.raises((DataError, CloudError)) as info:
        S3DataSets("", "us-east-1").listing(parse_s3("s3://signed/set"))
    assert "access denied" in info.value.message or "rejected the credentials" in info.value.message


def test_no_credentials_is_said_before_anything_is_read(aws, monkeypatch, tmp_path):
    from gpuctl.provision.aws.datasets import S3DataSets

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(CloudError) as info:
        S3DataSets("", "us-east-1")
    assert info.value.message == "no AWS credentials found"
