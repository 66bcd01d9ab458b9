"""Files of this user's alone in the gpuctl home, written whole or not at all."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def unique_suffix() -> str:
    """For temporary names: two writers of one place at once must not share one."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def write_private(path: Path, data: bytes | str) -> None:
    """`data` in `path`, mode 0600 from the first byte (a fresh file beside it, then renamed): a
    reader sees the old file or the new one, never half of one, and a link planted at the
    temporary name is refused rather than followed. The temporary file goes on any error."""
    tmp = path.with_name(f".{path.name}.{unique_suffix()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
