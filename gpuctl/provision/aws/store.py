"""The aws provider's checkpoint store: one S3 bucket per gpuctl owner, account and region, where
each cluster's instance keeps its runs' checkpoints and reports (`clusters/<cluster>/runs/<run>/`)
so that they outlive a spot interruption.

The bucket is made on first use and set up to be private and cheap to forget: default encryption
(SSE-S3), all four public-access blocks, a policy refusing plain HTTP, gpuctl's tags, and a
lifecycle rule that expires checkpoints after `aws.checkpoint_expiry_days` (and drops uploads an
interruption left half done). `down` never deletes it or its objects; `gpuctl runs rm` does, a
run at a time. Each cluster's instance reaches only its own prefix (store_iam.py).

Keys read back from the bucket are untrusted (anything with the bucket's write access may have
put them): only keys under the expected prefix, without `..`, `.`, empty or absolute parts, count
as a run's files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from gpuctl import seams
from gpuctl.config.settings import validate_name
from gpuctl.errors import CloudError, ConfigError, GpuctlError
from gpuctl.model.images import StoreTarget
from gpuctl.provision.aws import access, store_iam, store_pull
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate

Progress = Callable[[str], None]
CLUSTERS = "clusters/"
TAG_STORE = "gpuctl:store"  # what the bucket was set up as: written last, so a half-done setup is redone
STORE_VERSION = 2  # 2: versioning and its expiry: buckets set up as 1 are set up again
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
COPY_LIMIT = 5 * 1024 ** 3  # CopyObject copies up to 5 GB; larger objects need the managed (multipart) copy
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def bucket_name(account: str, region: str, owner: str) -> str:
    """`gpuctl-<account>-<region>-<owner hash>`: lowercase, at most 63 characters, unique to this
    install in this account and region (bucket names are global: the account keeps others' apart)."""
    name = f"gpuctl-{account}-{region}-{store_iam.owner_hash(owner)}".lower()
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9][a-z0-9-]*[a-z0-9]", name), name
    return name


STORE_ID = re.compile(r"[0-9a-f]{12}")


def cluster_prefix(place: str) -> str:
    """`clusters/<name>.<id>/` for the place a cluster has in the store (ClusterSpec.store_place:
    a later cluster of the same name has another id), `clusters/<name>/` for one made before ids."""
    name, _, store_id = place.partition(".")
    try:
        validate_name(name)
        if "." in place and not STORE_ID.fullmatch(store_id):
            raise ValueError(f"{store_id!r} is no store id")
    except ValueError as exc:
        raise ConfigError(f"cluster {place!r} cannot name a place in the store: {exc}") from None
    return f"{CLUSTERS}{place}/"


def run_prefix(cluster: str, run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise ConfigError(f"{run_id!r} is no run id", "Run ids look like proj-20261130-101500-ab12 (`gpuctl status`).")
    return f"{cluster_prefix(cluster)}runs/{run_id}/"


def safe_relative(key: str, prefix: str) -> str | None:
    """The part of `key` under `prefix`, if it is a plain relative path; None for anything else
    (outside the prefix, empty, absolute, `.` or `..` parts, backslashes, control characters)."""
    if not key.startswith(prefix):
        return None
    rel = key[len(prefix):]
    if not rel or rel.startswith("/") or "\\" in rel or any(ord(c) < 32 or ord(c) == 127 for c in rel):
        return None
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    return rel


def lifecycle_rules(expiry_days: int) -> list[dict[str, Any]]:
    """Uploads a spot interruption cut short are dropped after a day (their parts cost storage and
    no listing shows them); checkpoints expire after `expiry_days` (0: kept until `runs rm`)."""
    if expiry_days < 0:
        raise ConfigError(f"aws.checkpoint_expiry_days is {expiry_days}", "Use 0 (keep until `gpuctl runs rm`) or more.")
    rules: list[dict[str, Any]] = [{"ID": "gpuctl-abort-incomplete-uploads", "Status": "Enabled",
                                    "Filter": {"Prefix": ""},
                                    "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}]
    if expiry_days:
        rules.append({"ID": "gpuctl-checkpoint-expiry", "Status": "Enabled", "Filter": {"Prefix": CLUSTERS},
                      "Expiration": {"Days": expiry_days}})
    return rules


def version_rules(versions_days: int) -> list[dict[str, Any]]:
    """With versioning on: a checkpoint overwritten or deleted (by the instance, whose role may do
    both) stays as a noncurrent version for `versions_days`, then goes; a delete marker left with no
    version behind it goes too."""
    if not versions_days:
        return []
    return [{"ID": "gpuctl-earlier-versions", "Status": "Enabled", "Filter": {"Prefix": CLUSTERS},
             "NoncurrentVersionExpiration": {"NoncurrentDays": versions_days}},
            {"ID": "gpuctl-lone-delete-markers", "Status": "Enabled", "Filter": {"Prefix": CLUSTERS},
             "Expiration": {"ExpiredObjectDeleteMarker": True}}]


def tls_only_policy(bucket: str, partition: str = "aws") -> dict[str, Any]:
    arn = f"arn:{partition}:s3:::{bucket}"
    return {"Version": "2012-10-17", "Statement": [{
        "Sid": "TlsOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": [arn, f"{arn}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]}


def bucket_tags(owner: str, marker: str) -> list[dict[str, str]]:
    return [{"Key": access.TAG_CREATED_BY, "Value": "gpuctl"}, {"Key": access.TAG_OWNER, "Value": owner},
            {"Key": "Name", "Value": "gpuctl checkpoints"}, {"Key": TAG_STORE, "Value": marker}]


class S3Store:
    """The CheckpointStore of an aws cluster (provision.CheckpointStore)."""

    def __init__(self, ctx: AwsContext):
        self.ctx = ctx
        self._aws: Aws | None = None
        self._account: str | None = None
        self._ready: str | None = None  # the marker the bucket was found or set up with by this store

    # --- where ---------------------------------------------------------------------------------

    @property
    def aws(self) -> Aws:
        if self._aws is None:
            self._aws = self.ctx.aws(self.ctx.spec.region)
        return self._aws

    @property
    def region(self) -> str:
        return self.aws.region

    @property
    def partition(self) -> str:
        try:
            return self.aws.session.get_partition_for_region(self.region) or "aws"
        except Exception:  # noqa: BLE001 - an older botocore without it: the commercial partition
            return "aws"

    @property
    def account(self) -> str:
        if self._account is None:
            self._account = call(self.aws.client("sts").get_caller_identity)["Account"]
        return self._account

    @property
    def bucket(self) -> str:
        return bucket_name(self.account, self.region, self.ctx.owner)

    def s3(self) -> Any:
        return self.aws.client("s3")

    # --- the contract --------------------------------------------------------------------------

    def target(self, cluster: str) -> StoreTarget:
        """The cluster's place in the bucket (`cluster`: its ClusterSpec.store_place); the bucket
        is made and set up first if need be."""
        prefix = cluster_prefix(cluster)
        try:
            self.ensure_bucket()
        except GpuctlError as exc:
            raise store_iam.denied(exc, "the checkpoint bucket", "s3") from exc.__cause__
        return StoreTarget(bucket=self.bucket, prefix=prefix, region=self.region, endpoint=seams.s3_endpoint())

    def prepare(self, cluster: str, place: str, progress: Progress) -> tuple[StoreTarget, str]:
        """What a launch needs before RunInstances: the instance profile of the cluster (named
        `cluster`, its place in the store `place`) and the bucket (the profile first: without IAM
        nothing is made; if the bucket then fails, the profile goes again). (target, instance
        profile name)."""
        boundary = store_iam.boundary_arn(self.aws, self.account, self.partition)
        profile = store_iam.ensure_profile(self.aws, self.ctx.owner, cluster, self.region, self.bucket, self.partition,
                                           progress, boundary=boundary, place=place)
        try:
            target = self.target(place)
        except GpuctlError:
            try:
                store_iam.delete_profile(self.aws, profile)
            except GpuctlError:
                pass  # `down` finds it by its path and tags
            raise
        progress(f"checkpoints: s3://{target.bucket}/{target.prefix} (encrypted, private, "
                 f"{self._expiry_words()})")
        return target, profile

    def files(self, cluster: str, run_id: str) -> list[tuple[str, int]]:
        prefix = run_prefix(cluster, run_id)
        out = []
        for key, size in self._list(prefix):
            rel = safe_relative(key, prefix)
            if rel is not None:
                out.append((rel, size))
        return sorted(out)

    def copy(self, from_cluster: str, to_cluster: str, run_id: str) -> int:
        src, dst = run_prefix(from_cluster, run_id), run_prefix(to_cluster, run_id)
        s3, n = self.s3(), 0
        for key, size in self._list(src):
            rel = safe_relative(key, src)
            if rel is None:
                continue
            source = {"Bucket": self.bucket, "Key": key}
            if size <= COPY_LIMIT:
                call(s3.copy_object, CopySource=source, Bucket=self.bucket, Key=dst + rel,
                     ExpectedBucketOwner=self.account, ExpectedSourceBucketOwner=self.account)
            else:
                call(s3.copy, source, self.bucket, dst + rel)
            n += 1
        return n

    def download(self, cluster: str, run_id: str, dest: Path, leave_out: tuple[str, ...] = ()
                 ) -> tuple[int, tuple[str, ...]]:
        prefix = run_prefix(cluster, run_id)
        return store_pull.download(self.s3(), self.bucket, self.account, self._list(prefix), prefix, dest, leave_out,
                                   safe_relative)

    def remove(self, cluster: str, run_id: str) -> int:
        """Every object under the run's prefix, the odd keys too (deleting names no file here)."""
        return self.remove_prefix(run_prefix(cluster, run_id))

    def remove_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix` (a folder ending in "/"), 1000 a request; how many."""
        assert prefix.endswith("/") and prefix != "/", prefix
        keys = [k for k, _ in self._list(prefix) if k.startswith(prefix)]
        s3 = self.s3()
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i:i + DELETE_BATCH]
            res = call(s3.delete_objects, Bucket=self.bucket, ExpectedBucketOwner=self.account,
                       Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = res.get("Errors", [])
            if errors:
                first = errors[0]
                raise CloudError(f"S3 kept {len(errors)} of the objects under {prefix}: {first.get('Key')}: "
                                 f"{first.get('Code')} {first.get('Message', '')}".rstrip(), "Run the command again.")
        return len(keys)

    def usage(self) -> dict[tuple[str, str], int]:
        """Bytes per (cluster, run id) in this owner's bucket of the region; nothing when there is
        no bucket yet (usage never makes one)."""
        out: dict[tuple[str, str], int] = {}
        try:
            for key, size in self._list(CLUSTERS, quick=True):
                parts = key.split("/")
                if len(parts) < 5 or parts[2] != "runs" or safe_relative(key, f"{CLUSTERS}{parts[1]}/runs/{parts[3]}/") is None:
                    continue
                try:
                    cluster_prefix(parts[1])  # a place gpuctl would make: anything else is not a cluster's
                except ConfigError:
                    continue
                out[(parts[1], parts[3])] = out.get((parts[1], parts[3]), 0) + size
        except GpuctlError as exc:
            if exc.__cause__ is not None and error_code(exc.__cause__) == "NoSuchBucket":
                return {}
            raise
        return out

    # --- the bucket ----------------------------------------------------------------------------

    def _expiry_words(self) -> str:
        days = self.ctx.spec.checkpoint_expiry_days
        return f"expire after {days} days" if days else "kept until `gpuctl runs rm`"

    def ensure_bucket(self) -> None:
        """Make the bucket if it is not there, and set it up unless its marker tag says it is
        already, as asked now. Idempotent; another account's bucket of that name is refused."""

        bucket, region, s3 = self.bucket, self.region, self.s3()
        versions = self.ctx.spec.checkpoint_versions_days
        marker = f"v{STORE_VERSION}-expiry{self.ctx.spec.checkpoint_expiry_days}-versions{versions}"
        if self._ready == marker:
            return
        rules = lifecycle_rules(self.ctx.spec.checkpoint_expiry_days) + version_rules(versions)
        try:
            s3.head_bucket(Bucket=bucket, ExpectedBucketOwner=self.account)
            exists = True
        except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
            code = error_code(exc)
            if code in ("403", "AccessDenied"):
                raise CloudError(f"bucket {bucket} exists but this account cannot use it (another account's, or no "
                                 "s3:ListBucket permission)", store_iam.NO_IAM_HINT) from exc
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise translate(exc, "HeadBucket") from exc
            exists = False
        if exists:
            try:
                tags = {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=bucket).get("TagSet", [])}
            except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
                if error_code(exc) != "NoSuchTagSet":
                    raise translate(exc, "GetBucketTagging") from exc
                tags = {}
            if tags.get(TAG_STORE) == marker and tags.get(access.TAG_OWNER) == self.ctx.owner:
                self._ready = marker
                return
        else:
            where = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            try:
                s3.create_bucket(Bucket=bucket, **where)
            except aws_errors() as exc:  # a connection failure, an answer that is not the API's too
                if error_code(exc) == "BucketAlreadyExists":
                    raise CloudError(f"the bucket name {bucket} is taken by another account",
                                     store_iam.NO_IAM_HINT) from exc
                if error_code(exc) != "BucketAlreadyOwnedByYou":
                    raise translate(exc, "CreateBucket") from exc
        call(s3.put_bucket_encryption, Bucket=bucket, ExpectedBucketOwner=self.account,
             ServerSideEncryptionConfiguration={"Rules": [
                 {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}, "BucketKeyEnabled": True}]})
        call(s3.put_public_access_block, Bucket=bucket, ExpectedBucketOwner=self.account,
             PublicAccessBlockConfiguration={"BlockPublicAcls": True, "IgnorePublicAcls": True,
                                             "BlockPublicPolicy": True, "RestrictPublicBuckets": True})
        call(s3.put_bucket_policy, Bucket=bucket, ExpectedBucketOwner=self.account,
             Policy=json.dumps(tls_only_policy(bucket, self.partition)))
        if versions or exists:  # a bucket versioned before and asked for none now: suspended
            call(s3.put_bucket_versioning, Bucket=bucket, ExpectedBucketOwner=self.account,
                 VersioningConfiguration={"Status": "Enabled" if versions else "Suspended"})
        call(s3.put_bucket_lifecycle_configuration, Bucket=bucket, ExpectedBucketOwner=self.account,
             LifecycleConfiguration={"Rules": rules})
        call(s3.put_bucket_tagging, Bucket=bucket, ExpectedBucketOwner=self.account,
             Tagging={"TagSet": bucket_tags(self.ctx.owner, marker)})
        self._ready = marker

    def _list(self, prefix: str, quick: bool = False) -> Iterator[tuple[str, int]]:
        """(key, bytes) of every object under the prefix (ListObjectsV2, 1000 a page). `quick`:
        a client that gives up soon (`cost` must answer even without a network)."""
        for key, size, _ in self.listing(prefix, quick):
            yield key, size

    def listing(self, prefix: str, quick: bool = False) -> Iterator[tuple[str, int, str]]:
        """(key, bytes, ETag as S3 lists it) of every object under the prefix."""
        s3 = self.s3()
        if quick:
            from botocore.config import Config

            s3 = self.aws.session.client("s3", region_name=self.region, config=Config(
                retries={"mode": "standard", "max_attempts": 2}, connect_timeout=3, read_timeout=10))
        try:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                 ExpectedBucketOwner=self.account)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"], int(obj.get("Size", 0)), str(obj.get("ETag", ""))
        except aws_errors() as exc:  # botocore's errors, translated once here
            raise translate(exc, "ListObjectsV2") from exc
