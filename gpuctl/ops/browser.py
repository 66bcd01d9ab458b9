"""A page served on 127.0.0.1 with a token, opened in the browser without the token on any
command line (other users see command lines): the browser is given a private file:// page that
redirects to the address. `gpuctl dashboard` and `gpuctl notebook` open theirs so."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """`text` in a file of this user's alone, whole or not at all (a fresh 0600 file, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def opener(home: Path, name: str, address: str, what: str) -> str:
    """A file:// page (home/name, 0600) that sends the browser on to `address`."""
    page = home / name
    write_private(page, f'<!doctype html><meta http-equiv="refresh" content="0;url={address}">'
                        f'<p>Opening {what}...</p>\n')
    return page.as_uri()
