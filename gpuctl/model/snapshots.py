"""Data snapshots: a local directory uploaded once (`gpuctl data push DIR --name NAME`) to the
gpuctl bucket of an AWS region, under `data/NAME/`, and trained from as `--data gpuctl:NAME`: it
resolves to that S3 prefix and is fetched by each node like any `s3://` data set (ops/datasets.py).
The ledger keeps each snapshot's record (ledger/snapshots.py) for `data ls`, `data rm` and `cost`.
"""

from __future__ import annotations

import re
from typing import Optional

from gpuctl.errors import ConfigError
from gpuctl.model import billing
from gpuctl.model.data import S3Source
from gpuctl.model.specs import Frozen

SCHEME = "gpuctl:"
PREFIX = "data/"  # below it, one folder per snapshot: data/NAME/ (the checkpoints are under clusters/)
# A snapshot's name becomes an S3 folder and a file name here: as plain as a volume's.
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
NAME_HINT = "Use 1-40 lowercase letters, digits or '-', starting with a letter or digit (e.g. --name cifar10)."


class Snapshot(Frozen):
    """One snapshot as the ledger keeps it (from the end of its first push until `data rm`)."""

    name: str
    region: str
    bucket: str
    files: int
    bytes: int
    created_at: float  # its first push
    pushed_at: float  # its latest push
    last_used_at: Optional[float] = None  # the latest `train --data gpuctl:NAME`
    source_dir: str = ""  # the directory pushed last (shown; never read again)
    # False from the start of a push to its end: a push cut short (Ctrl-C, a network) leaves a data
    # set that is part old, part new, which `train` refuses and the next push completes.
    complete: bool = True
    usd_per_gb_month: float = billing.S3_STANDARD_USD_PER_GB_MONTH

    @property
    def prefix(self) -> str:
        return prefix_of(self.name)

    @property
    def source(self) -> S3Source:
        return S3Source(bucket=self.bucket, prefix=self.prefix)

    @property
    def gb(self) -> float:
        return self.bytes / 2 ** 30  # S3 bills GB-months of 2^30 bytes

    @property
    def usd_per_month(self) -> float:
        return self.gb * self.usd_per_gb_month


def is_snapshot(text: str) -> bool:
    return text.startswith(SCHEME)


def check_name(name: str, what: str = "data set name") -> str:
    if not NAME.fullmatch(name):
        shown = name[:60].encode("unicode_escape").decode("ascii")
        raise ConfigError(f"{what} {shown!r} is not allowed", NAME_HINT)
    return name


def prefix_of(name: str) -> str:
    return f"{PREFIX}{check_name(name)}/"


def name_of(text: str) -> str:
    """NAME of `gpuctl:NAME` (checked)."""
    return check_name(text[len(SCHEME):], f"--data {SCHEME}NAME:")
