"""`gpuctl pull RUN` after `down` on aws: the run's files from the checkpoint store (where each
save put its outputs, checkpoint, reports and log) into a directory here. The keys are untrusted
(whoever can write the bucket chose them): only plain relative paths under the run's prefix are
written, never through a link, and each file lands whole (a temporary name, then a rename)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from gpuctl.provision.aws.session import call
from gpuctl.files import unique_suffix


def download(s3: Any, bucket: str, account: str, objects: Iterator[tuple[str, int]], prefix: str, dest: Path,
             leave_out: tuple[str, ...], safe_relative: Any) -> tuple[int, tuple[str, ...]]:
    """Each object under `prefix` into `dest` but for the top-level names in `leave_out`: (files
    written, "key: why" of each one skipped)."""
    count, skipped = 0, []
    root = dest.resolve()
    for key, _size in objects:
        rel = safe_relative(key, prefix)
        if rel is None:
            skipped.append(f"{key[:200]!r}: not a plain path under the run's prefix")
            continue
        if rel.split("/")[0] in leave_out:
            continue
        path = root / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.parent.resolve().is_relative_to(root) or path.is_symlink() or path.is_dir():
                skipped.append(f"{rel}: a directory or link here already has that name")
                continue
            part = path.with_name(f".{path.name}.{unique_suffix()}.part")
            call(s3.download_file, bucket, key, str(part), ExtraArgs={"ExpectedBucketOwner": account})
            os.replace(part, path)
        except OSError as exc:  # a name past the system's limits, a file where a directory goes
            skipped.append(f"{rel}: {exc.strerror or exc}")
            continue
        count += 1
    return count, tuple(skipped)
