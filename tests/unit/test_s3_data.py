"""The pure parts of `--data s3://...`: the URL parsed (each malformed one refused, saying why),
its place in the host's data store, the listing's keys refused before anything starts, what
crossing regions costs, the progress line, and the presigned links: byte for byte the ones
botocore makes (gpuctl signs them itself, one HMAC each)."""

from __future__ import annotations

import calendar
import time
import urllib.parse

import pytest

from gpuctl.errors import DataError, ExitCode
from gpuctl.model import billing
from gpuctl.model.data import S3Listing, S3Source, is_s3, parse_s3, size_text
from gpuctl.ops import datasets
from gpuctl.payloads import gpuctl_s3sign as sign
from gpuctl.provision.aws.presign import Presigner


@pytest.mark.parametrize("text, bucket, prefix", [
    ("s3://my-bucket", "my-bucket", ""),
    ("s3://my-bucket/", "my-bucket", ""),
    ("s3://my-bucket/data/cifar", "my-bucket", "data/cifar/"),
    ("s3://my-bucket/data/cifar/", "my-bucket", "data/cifar/"),
    ("s3://my.dotted.bucket/x y/é", "my.dotted.bucket", "x y/é/"),
])
def test_a_url_names_a_bucket_and_a_folder(text, bucket, prefix):
    source = parse_s3(text)
    assert (source.bucket, source.prefix) == (bucket, prefix)
    assert source.url == f"s3://{bucket}/{prefix}"


@pytest.mark.parametrize("text, said", [
    ("s3:/b/x", "not an s3:// URL"), ("S3://bucket/x", "lowercase"), ("s3://", "names no bucket"),
    ("s3:///x", "names no bucket"), ("s3://ab/x", "not an S3 bucket name"), ("s3://UPPER/x", "not an S3 bucket name"),
    ("s3://-dash/x", "not an S3 bucket name"), ("s3://a..b/x", "not an S3 bucket name"),
    ("s3://192.168.1.1/x", "not an S3 bucket name"), ("s3://b" + "x" * 63, "not an S3 bucket name"),
    ("s3://bucket/a*", "without wildcards"), ("s3://bucket/a//b", "empty parts"),
    ("s3://bucket/x\x1b[2J", "control character"), ("s3://bucket/" + "p" * 1001, "over S3's 1024"),
])
def test_a_malformed_url_is_refused_saying_why(text, said):
    assert is_s3(text) or not text.lower().startswith("s3:")
    with pytest.raises(DataError) as info:
        parse_s3(text)
    assert said in info.value.message and info.value.exit_code == ExitCode.DATA
    assert "\x1b" not in info.value.message and "s3://" in info.value.hint


def test_each_url_has_its_own_place_in_the_store():
    a, b = parse_s3("s3://bkt/a"), parse_s3("s3://bkt/b")
    assert a.place.startswith("s3-bkt-") and len(a.place) == len("s3-bkt-") + 8 and a.place != b.place
    assert parse_s3("s3://bkt/a/").place == a.place


def listing(*rels: str) -> S3Listing:
    return S3Listing(source=S3Source(bucket="bkt", prefix="p/"), region="us-east-1",
                     objects=tuple((r, 1, "e") for r in rels), total_bytes=len(rels))


def test_unsafe_keys_refuse_the_listing_naming_them_and_why():
    with pytest.raises(DataError) as info:
        datasets.refuse_unsafe(listing("fine", "../up", "a//b", "bell\x07", "fine/under", *[f"../{i}" for i in range(5)]))
    msg = info.value.message
    assert "holds 9 key(s)" in msg and "'../up' (a '.' or '..' part)" in msg and "and 4 more" in msg
    assert "\x07" not in msg
    datasets.refuse_unsafe(listing("a", "b/c", "d/e/f"))  # plain ones pass


@pytest.mark.parametrize("bucket, where, per_gb", [("us-east-1", "us-east-1", 0.0), ("eu-west-1", "us-east-1", 0.02),
                                                   ("us-east-1", None, 0.09)])
def test_what_a_gb_costs_to_fetch(bucket, where, per_gb):
    assert billing.s3_transfer(bucket, where)[0] == per_gb


def test_the_progress_line_says_files_bytes_rate_and_time_left():
    line = datasets.progress_line({"files_done": 1234, "files_total": 10000, "bytes_done": 250e6, "bytes_total": 1e9,
                                   "fetched_bytes": 200e6, "elapsed": 2.0})
    assert line == "data: 1,234/10,000 files, 250.0 MB/1.0 GB, 100.0 MB/s, 8s left"
    assert datasets.progress_line({"files_done": "x", "elapsed": -1}).startswith("data: 0/0 files")
    assert size_text(512) == "512 B" and size_text(20.3e9) == "20.3 GB"


@pytest.mark.parametrize("endpoint, style", [("https://s3.eu-west-1.amazonaws.com", "virtual"),
                                             ("http://127.0.0.1:5000", "path")])
@pytest.mark.parametrize("token", [None, "session/token+="])
def test_the_links_are_botocore_s_own(monkeypatch, endpoint, style, token):
    import boto3
    from botocore.config import Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret/key+x")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    if token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    else:
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    extra = {} if style == "virtual" else {"endpoint_url": endpoint}
    client = boto3.session.Session().client("s3", region_name="eu-west-1", **extra,  # its own credentials
                          config=Config(signature_version="s3v4", s3={"addressing_style": style}))
    signer = Presigner("AKIDEXAMPLE", "secret/key+x", token, "eu-west-1", endpoint, style == "virtual")
    for key in ("data/a b+c.png", "data/名前/ü~x", "plain", "a=b&c?d#e%f", "sp ace/;,:@!$'()"):
        theirs = client.generate_presigned_url("get_object", Params={"Bucket": "my-bkt", "Key": key}, ExpiresIn=3600)
        stamp = urllib.parse.parse_qs(urllib.parse.urlsplit(theirs).query)["X-Amz-Date"][0]
        now = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
        assert signer.links("my-bkt", [key], 3600, now) == [theirs], key
        # As a plan carries it: the template below the key's folder and the key's own signature.
        folder, _, rel = key.rpartition("/")
        prefix = folder + "/" if folder else ""
        template, signed = signer.signer("my-bkt", prefix, 3600, now)
        signature = signed(rel)
        assert sign.template_link(template, rel, signature) == theirs, key
        assert len(signature) == 64 and (token is None or token in urllib.parse.unquote(template["query"]))


def test_the_plan_carries_the_links_template_once_and_a_signature_per_missing_object():
    """100,000 links with a session token are ~150 MB of plan: it carries what they share once."""
    import json

    from gpuctl.payloads import gpuctl_datacache as cache
    from tests.fakes import FakeHost

    objects = tuple((f"d/f{i:05d}.bin", i, f"{i:032x}") for i in range(2500))  # more than a chunk
    listing = S3Listing(source=S3Source(bucket="bkt", prefix="p/"), region="us-east-1", objects=objects,
                        total_bytes=sum(o[1] for o in objects))
    token = "T" * 1000
    signer = Presigner("AKID", "secret", token, "us-east-1", "https://s3.us-east-1.amazonaws.com", True).signer(
        "bkt", "p/", 3600, 0)
    host = FakeHost()
    path = datasets._plan(host, datasets.Fetch(None, listing, 3600, None), {3, 2400}, sign=True,  # type: ignore[arg-type]
                          signer=signer)
    text = host.files[path]
    assert text.count(token.encode()) == 1 and len(text) < 2500 * 80 + 2000
    plan = cache.load_plan_data(json.loads(text))
    assert [o[:3] for o in plan["objects"]] == list(objects)
    assert [i for i, o in enumerate(plan["objects"]) if o[3]] == [3, 2400]
    whole = Presigner("AKID", "secret", token, "us-east-1", "https://s3.us-east-1.amazonaws.com", True).links(
        "bkt", ["p/d/f02400.bin"], 3600, 0)
    assert sign.template_link(plan["link"], "d/f02400.bin", plan["objects"][2400][3]) == whole[0]


@pytest.mark.parametrize("token", [None, "session/token+="])
def test_the_listing_s_signature_is_botocore_s_own(token):
    """The Authorization header of a ListObjectsV2 request (s3http.py's), as botocore's S3SigV4Auth
    signs it (over http, where it hashes the empty body as gpuctl does)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    query = [("list-type", "2"), ("prefix", "data/a b+c/名前/"), ("encoding-type", "url"),
             ("continuation-token", "1/ab+c==")]
    url = "http://127.0.0.1:5000/my-bkt?" + sign.canonical_query(query)
    request = AWSRequest(method="GET", url=url, headers={})
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+x", token), "s3", "eu-west-1").add_auth(request)
    now = calendar.timegm(time.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
    ours = sign.authorization(sign.Credentials("AKIDEXAMPLE", "secret/key+x", token), "eu-west-1", "GET",
                              "127.0.0.1:5000", "/my-bkt", query, now)
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours.get("x-amz-security-token") == request.headers.get("X-Amz-Security-Token")
