"""A data set in S3 (`train --data s3://BUCKET/PREFIX`) as this machine reads it with the user's
credentials (botocore's own chain; any provider's cluster may use one): the bucket's region, its
objects below the prefix, and presigned GET links for a host to fetch them with (presign.py).
Read over HTTP with gpuctl's own SigV4 (s3http.py), without boto3's client: 100,000 objects
listed in well under 100 MB. Every way this can go wrong before anything starts is a DataError
that says which: no such bucket, access denied, nothing there."""

from __future__ import annotations

from typing import Callable

from gpuctl import seams
from gpuctl.errors import DataError, GpuctlError
from gpuctl.model.data import S3Listing, S3Source
from gpuctl.provision.aws.presign import Presigner
from gpuctl.provision.aws.s3http import Answer, Failed, S3Http
from gpuctl.provision.aws.session import translate

DENIED_HINT = ("Your AWS identity needs s3:ListBucket on the bucket and s3:GetObject on the prefix's objects "
               "(docs/data.md); check with `aws s3 ls {url}`.")
MISSING = ("404", "NoSuchBucket")
DENIED = ("403", "AccessDenied", "AllAccessDisabled", "AccessDeniedException")


class S3DataSets:
    """`provision.DataSets` for S3: the user's credentials (profile; `region` only where the
    bucket's own cannot be found, which S3 says with every answer)."""

    def __init__(self, profile: str = "", region: str = "") -> None:
        self.http = S3Http(profile, region or "us-east-1")
        self.http.credentials()  # no credentials: said before anything else

    def region_of(self, source: S3Source) -> str:
        """The bucket's region (HeadBucket's x-amz-bucket-region, which S3 sends with a 301, a 400
        or a 403 as well); DataError when it does not exist or may not be looked at."""
        status, headers = self.http.head_bucket(source.bucket, self.http.region)
        if status == 200:
            return headers.get("x-amz-bucket-region") or self.http.region
        if str(status) in MISSING:
            raise DataError(f"bucket {source.bucket!r} does not exist",
                            f"Check the name in {source.url} (`aws s3 ls` lists your buckets).")
        if str(status) in DENIED:
            raise DataError(f"access denied to bucket {source.bucket!r} (s3:ListBucket)",
                            DENIED_HINT.format(url=source.url))
        if headers.get("x-amz-bucket-region"):  # a 301 or 400: the bucket lives in another region
            return headers["x-amz-bucket-region"]
        raise _error(Answer(status, headers, str(status), ""), "HeadBucket")

    def listing(self, source: S3Source) -> S3Listing:
        """Every object below the prefix (its path there, size, ETag); folder markers (a key ending
        in '/', no bytes) left out. DataError: no such bucket, access denied, or nothing there."""
        region = self.region_of(source)
        objects: list[tuple[str, int, str]] = []
        total = 0
        cut = len(source.prefix)
        try:
            for page in self.http.pages(source.bucket, source.prefix, region):
                for key, size, etag in page:
                    if key.endswith("/") and size == 0:
                        continue  # the console's "folder"
                    objects.append((key[cut:], size, etag))
                    total += size
        except Failed as failed:
            if failed.answer.code in MISSING:
                raise DataError(f"bucket {source.bucket!r} does not exist",
                                f"Check the name in {source.url}.") from failed
            if failed.answer.code in DENIED:
                raise DataError(f"access denied listing {source.url} (s3:ListBucket)",
                                DENIED_HINT.format(url=source.url)) from failed
            raise _error(failed.answer, "ListObjectsV2") from failed
        if not objects:
            raise DataError(f"{source.url} holds no objects",
                            f"Check the prefix (`aws s3 ls {source.url}`): --data names a folder of the bucket "
                            "(s3://BUCKET/FOLDER), not one file.")
        # Built here of checked types: not validated again (pydantic would copy 100,000 tuples).
        return S3Listing.model_construct(source=source, region=region, objects=tuple(objects), total_bytes=total)

    def signer(self, listing: S3Listing, expires_s: int) -> tuple[dict[str, str], Callable[[str], str]]:
        """Presigned GET links for the paths below the listing's prefix, valid `expires_s`, as a
        plan carries them: their shared template and a function signing one path (gpuctl_s3sign)."""
        creds = self.http.credentials()
        endpoint = seams.s3_endpoint() or self.http.endpoint(listing.region)
        source = listing.source
        # AWS's own endpoint: bucket.s3.REGION.amazonaws.com (a dotted name would not match the
        # certificate there, so it goes in the path); any other endpoint: the bucket in the path.
        virtual = endpoint.endswith((".amazonaws.com", ".amazonaws.com.cn")) and "." not in source.bucket
        signer = Presigner(creds.access_key, creds.secret_key, creds.token, listing.region, endpoint, virtual)
        return signer.signer(source.bucket, source.prefix, expires_s)


def _error(answer: Answer, action: str) -> GpuctlError:
    """Any other error answer as boto3's would be translated (expired token, bad keys, ...)."""
    from botocore import exceptions as bx

    response = {"Error": {"Code": answer.code, "Message": answer.message},
                "ResponseMetadata": {"HTTPStatusCode": answer.status, "HTTPHeaders": answer.headers}}
    return translate(bx.ClientError(response, action), action)
