"""Data snapshots in S3 (`gpuctl data push DIR --name NAME`): a local directory uploaded to the
checkpoint store's bucket (store.py: one per owner, account and region, private, encrypted, TLS
only) under `data/NAME/`, changed files only, by the checkpoint store's own rule
(payloads/gpuctl_store.py push: a manifest of each file's size, mtime and ETag; here it is kept in
gpuctl's home, never in the user's directory). The bucket's lifecycle rules expire `clusters/`
only: a snapshot stays until `gpuctl data rm`.

Trained from as `--data gpuctl:NAME`, which is `s3://BUCKET/data/NAME/` to the fetch
(ops/datasets.py): each node fetches it in its region, with the cluster's role where it has one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from gpuctl.errors import CloudError
from gpuctl.model.snapshots import prefix_of
from gpuctl.payloads import gpuctl_store
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.session import aws_errors, call, translate
from gpuctl.provision.aws.store import S3Store

Progress = Callable[[str], None]
# What boto3's managed upload (upload_file) sends for one file, by its size: put_object, or
# create_multipart_upload, upload_part, complete_multipart_upload (abort_multipart_upload when it
# fails): s3:PutObject to IAM. Named here so that the IAM policy test finds them.
MANAGED_UPLOAD = ("put_object", "create_multipart_upload", "upload_part", "complete_multipart_upload",
                  "abort_multipart_upload")
SAY_EVERY_S = 2.0


class _Bucket:
    """What gpuctl_store.push needs of a store (list, upload, delete), with this machine's
    credentials (boto3's chain) and gpuctl's client."""

    def __init__(self, store: S3Store, config: Any = None):
        from boto3.s3.transfer import TransferConfig

        self.store, self.s3, self.bucket = store, store.s3(), store.bucket
        # 4 parts of 16 MB at once: ~64 MB in flight at most (S3 allows 10,000 parts: files to 160 GB).
        self.config = config or TransferConfig(multipart_chunksize=16 << 20, max_concurrency=4)

    def list(self, prefix: str) -> dict[str, tuple[int, str]]:
        return {key: (size, etag) for key, size, etag in self.store.listing(prefix)}

    def upload(self, path: str, key: str) -> None:
        try:
            self.s3.upload_file(path, self.bucket, key, Config=self.config,
                                ExtraArgs={"ExpectedBucketOwner": self.store.account})
        except aws_errors() as exc:
            raise translate(exc, "PutObject") from exc
        except Exception as exc:  # boto3's S3UploadFailedError wraps botocore's ClientError
            cause = exc.__cause__ or exc.__context__
            if cause is not None and isinstance(cause, aws_errors()):
                raise translate(cause, "PutObject") from exc
            raise CloudError(f"S3 did not take {key}: {exc}", "Run `gpuctl data push` again: "
                             "what was uploaded stays, and only the rest goes.") from exc

    def delete(self, key: str) -> None:
        call(self.s3.delete_object, Bucket=self.bucket, Key=key, ExpectedBucketOwner=self.store.account)


class S3Snapshots:
    """The SnapshotStore of the aws provider (provision.SnapshotStore)."""

    def __init__(self, ctx: AwsContext):
        self.store = S3Store(ctx)
        self.transfer: Any = None  # boto3's TransferConfig for the uploads (None: _Bucket's)

    @property
    def region(self) -> str:
        return self.store.region

    @property
    def bucket(self) -> str:
        return self.store.bucket

    def push(self, name: str, directory: Path, manifest: Path, progress: Progress,
             starting: Callable[[], None] = lambda: None) -> dict[str, Any]:
        prefix = prefix_of(name)
        self.store.ensure_bucket()
        bucket = _Bucket(self.store, self.transfer)
        target = {"kind": "s3", "bucket": self.bucket, "prefix": "data/", "region": self.region}
        said, sent, sent_bytes = [0.0], [0], [0]

        def heard(rel: str, size: int) -> None:
            if not sent[0]:
                starting()
            sent[0] += 1
            sent_bytes[0] += size
            if time.monotonic() - said[0] >= SAY_EVERY_S:
                said[0] = time.monotonic()
                progress(f"data push: uploading file {sent[0]:,} ({sent_bytes[0] / 1e6:,.1f} MB so far)")

        manifest.parent.mkdir(parents=True, exist_ok=True)
        summary: dict[str, Any] = gpuctl_store.push(  # type: ignore[no-untyped-call]  # a payload: untyped, Python 3.8
            str(directory), target, prefix, delete=True, store=bucket, manifest=str(manifest), progress=heard)
        return summary

    def remove(self, name: str) -> int:
        return self.store.remove_prefix(prefix_of(name))
