"""A data set in S3 (`train --data s3://BUCKET/PREFIX`) as this machine reads it with the user's
credentials (boto3's own chain; any provider's cluster may use one): the bucket's region, its
objects below the prefix, and presigned GET links for a host to fetch them with (presign.py).
Every way this can go wrong before anything starts is a DataError that says which: no such
bucket, access denied, nothing there."""

from __future__ import annotations

from typing import Any, Callable

from gpuctl import seams
from gpuctl.errors import DataError
from gpuctl.model.data import S3Listing, S3Source
from gpuctl.provision.aws.presign import Presigner
from gpuctl.provision.aws.session import Aws, aws_errors, error_code, translate

DENIED_HINT = ("Your AWS identity needs s3:ListBucket on the bucket and s3:GetObject on the prefix's objects "
               "(docs/data.md); check with `aws s3 ls {url}`.")
MISSING = ("404", "NoSuchBucket")
DENIED = ("403", "AccessDenied", "AllAccessDisabled", "AccessDeniedException")


class S3DataSets:
    """`provision.DataSets` for S3: a boto3 session of the user's (profile; `region` only where the
    bucket's own cannot be found, which S3 says with every answer)."""

    def __init__(self, profile: str = "", region: str = "") -> None:
        self.aws = Aws(region or "us-east-1", profile)

    def region_of(self, source: S3Source) -> str:
        """The bucket's region (HeadBucket's x-amz-bucket-region, which S3 sends with a 301 or 403
        as well); DataError when it does not exist or may not be looked at."""
        s3 = self.aws.client("s3")
        try:
            answer = s3.head_bucket(Bucket=source.bucket)
        except aws_errors() as exc:
            code, headers = error_code(exc), _headers(exc)
            if code in MISSING:
                raise DataError(f"bucket {source.bucket!r} does not exist",
                                f"Check the name in {source.url} (`aws s3 ls` lists your buckets).") from exc
            if code in DENIED:
                raise DataError(f"access denied to bucket {source.bucket!r} (s3:ListBucket)",
                                DENIED_HINT.format(url=source.url)) from exc
            if headers.get("x-amz-bucket-region"):  # a 301: the bucket lives in another region
                return str(headers["x-amz-bucket-region"])
            raise translate(exc, "HeadBucket") from exc
        return str(_headers(answer).get("x-amz-bucket-region") or self.aws.region)

    def listing(self, source: S3Source) -> S3Listing:
        """Every object below the prefix (its path there, size, ETag); folder markers (a key ending
        in '/', no bytes) left out. DataError: no such bucket, access denied, or nothing there."""
        region = self.region_of(source)
        s3 = self.aws.client("s3", region)
        objects: list[tuple[str, int, str]] = []
        total = 0
        cut = len(source.prefix)
        try:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=source.prefix):
                for obj in page.get("Contents", ()):
                    rel, size = str(obj["Key"])[cut:], int(obj.get("Size", 0))
                    if rel.endswith("/") and size == 0:
                        continue  # the console's "folder"
                    objects.append((rel, size, str(obj.get("ETag", "")).strip('"')))
                    total += size
                del page
        except aws_errors() as exc:
            if error_code(exc) in MISSING:
                raise DataError(f"bucket {source.bucket!r} does not exist",
                                f"Check the name in {source.url}.") from exc
            if error_code(exc) in DENIED:
                raise DataError(f"access denied listing {source.url} (s3:ListBucket)",
                                DENIED_HINT.format(url=source.url)) from exc
            raise translate(exc, "ListObjectsV2") from exc
        if not objects:
            raise DataError(f"{source.url} holds no objects",
                            f"Check the prefix (`aws s3 ls {source.url}`): --data names a folder of the bucket "
                            "(s3://BUCKET/FOLDER), not one file.")
        # Built here of checked types: not validated again (pydantic would copy 100,000 tuples).
        return S3Listing.model_construct(source=source, region=region, objects=tuple(objects), total_bytes=total)

    def signer(self, listing: S3Listing, expires_s: int) -> tuple[dict[str, str], Callable[[str], str]]:
        """Presigned GET links for the paths below the listing's prefix, valid `expires_s`, as a
        plan carries them: their shared template and a function signing one path (gpuctl_s3sign)."""
        creds = self.aws.session.get_credentials()
        if creds is None:
            raise translate(_no_credentials())
        frozen = creds.get_frozen_credentials()
        endpoint = seams.s3_endpoint() or str(self.aws.client("s3", listing.region).meta.endpoint_url)
        source = listing.source
        # AWS's own endpoint: bucket.s3.REGION.amazonaws.com (a dotted name would not match the
        # certificate there, so it goes in the path); any other endpoint: the bucket in the path.
        virtual = endpoint.endswith(".amazonaws.com") and "." not in source.bucket
        signer = Presigner(frozen.access_key, frozen.secret_key, frozen.token, listing.region, endpoint, virtual)
        return signer.signer(source.bucket, source.prefix, expires_s)


def _headers(answer_or_exc: Any) -> dict[str, Any]:
    meta = getattr(answer_or_exc, "response", answer_or_exc) or {}
    return dict(meta.get("ResponseMetadata", {}).get("HTTPHeaders", {}))


def _no_credentials() -> BaseException:
    from botocore import exceptions as bx

    return bx.NoCredentialsError()
