"""A data set in S3 as `train --data s3://BUCKET/PREFIX` names it: the source (parsed here, refused
here when malformed), its listing as this machine read it with the user's credentials, and how
a host's fetch of it went. The fetch itself is gpuctl/payloads/gpuctl_fetch.py's."""

from __future__ import annotations

import hashlib
import re
from gpuctl.errors import DataError
from gpuctl.model.specs import Frozen

SCHEME = "s3://"
# S3's rules for a bucket's name (general purpose buckets): 3-63 characters, lowercase letters,
# digits, dots and hyphens, a letter or digit at each end, no two dots in a row, not an IP address.
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MALFORMED_HINT = "Name a bucket and a folder in it, e.g. `--data s3://my-bucket/datasets/cifar10`."


class S3Source(Frozen):
    bucket: str
    prefix: str = ""  # "" (the whole bucket) or a folder ending in "/"

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    @property
    def place(self) -> str:
        """Its directory in the host's data store, below data/: `s3-BUCKET-<8 hex of the URL>`,
        readable, and another prefix of the bucket never shares it."""
        return f"s3-{self.bucket[:40]}-{hashlib.sha256(self.url.encode()).hexdigest()[:8]}"


def is_s3(text: str) -> bool:
    """Meant as an S3 URL (`s3:/x`, `S3://x` too: parse_s3 then says what is wrong with it)."""
    return text.lower().startswith("s3:")


def parse_s3(text: str) -> S3Source:
    """`s3://BUCKET[/PREFIX]` as a source whose prefix is a folder ("a/b" and "a/b/" alike);
    DataError naming what is wrong with anything else."""
    shown = text.encode("unicode_escape").decode("ascii")
    if not text.startswith(SCHEME):
        raise DataError(f"--data {shown!r} is not an s3:// URL" + (" (the scheme is s3://, lowercase)" if is_s3(text) else ""),
                        MALFORMED_HINT)
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    if not bucket:
        raise DataError(f"--data {shown!r} names no bucket", MALFORMED_HINT)
    if not BUCKET.fullmatch(bucket) or ".." in bucket or re.fullmatch(r"[0-9.]+", bucket):
        raise DataError(f"--data {shown!r}: {bucket.encode('unicode_escape').decode('ascii')!r} is not an S3 bucket "
                        "name (3-63 lowercase letters, digits, dots and hyphens)", MALFORMED_HINT)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in prefix):
        raise DataError(f"--data {shown!r}: the prefix holds a control character", MALFORMED_HINT)
    if any(c in prefix for c in "*?[") or "//" in prefix or prefix.startswith("/"):
        raise DataError(f"--data {shown!r}: a prefix is a folder's path, without wildcards or empty parts",
                        MALFORMED_HINT)
    if len(prefix.encode()) > 1000:
        raise DataError(f"--data: the prefix is {len(prefix.encode())} bytes long, over S3's 1024 for a key",
                        MALFORMED_HINT)
    return S3Source(bucket=bucket, prefix=prefix.rstrip("/") + "/" if prefix else "")


class S3Listing(Frozen):
    """What the prefix holds, as listed from this machine: each object as (path below the prefix,
    size, ETag without quotes); folder markers (a key ending in '/' with no bytes) left out."""

    source: S3Source
    region: str  # the bucket's
    objects: tuple[tuple[str, int, str], ...]
    total_bytes: int


class FetchStats(Frozen):
    """How one host's fetch went (the chief's is the run's)."""

    files_total: int
    fetched: int  # objects downloaded this time
    fetched_bytes: int
    cached: int  # objects found here already (same key, size and ETag)
    cached_bytes: int
    removed: int = 0  # files no longer listed, removed from the host's copy
    retries: int = 0  # 5xx / SlowDown / cut connections waited out
    seconds: float
    data_dir: str
    changed_again: tuple[str, ...] = ()  # objects that changed mid-fetch and were fetched again


def size_text(n: float) -> str:
    """Bytes as people read them: 512 B, 1.5 MB, 20.3 GB (powers of 1000, as S3's prices count)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
