"""A page served on 127.0.0.1 with a token, opened in the browser without the token on any
command line (other users see command lines): the browser is given a private file:// page that
redirects to the address. `gpuctl dashboard` and `gpuctl notebook` open theirs so."""

from __future__ import annotations

from pathlib import Path

from gpuctl.files import write_private


def opener(home: Path, name: str, address: str, what: str) -> str:
    """A file:// page (home/name, 0600) that sends the browser on to `address`."""
    page = home / name
    write_private(page, f'<!doctype html><meta http-equiv="refresh" content="0;url={address}">'
                        f'<p>Opening {what}...</p>\n')
    return page.as_uri()
