"""Presigned S3 GET links made here with the user's credentials, for a host that has none: the
signing itself is the payload's (gpuctl_s3sign.py), the one implementation for both sides (an aws
instance signs with its role's credentials the same way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gpuctl.payloads import gpuctl_s3sign as sign

MAX_EXPIRES_S = sign.MAX_EXPIRES_S


@dataclass(frozen=True)
class Presigner:
    access_key: str
    secret_key: str
    token: str | None
    region: str
    endpoint: str  # scheme://host[:port] of the S3 endpoint the host reaches
    virtual_hosted: bool  # bucket.host/key (AWS's own endpoints); else host/bucket/key

    def links(self, bucket: str, keys: list[str], expires_s: int, now: float | None = None) -> list[str]:
        """One presigned GET link per key, valid for `expires_s` from `now`."""
        creds = sign.Credentials(self.access_key, self.secret_key, self.token)
        return sign.links(creds, self.region, self.endpoint, self.virtual_hosted, bucket, keys, expires_s, now)

    def signer(self, bucket: str, prefix: str, expires_s: int, now: float | None = None
               ) -> tuple[dict[str, str], Callable[[str], str]]:
        """The links to the objects below prefix as a plan carries them: (their shared template,
        a function signing one rel); gpuctl_s3sign.template_link makes each link of the two."""
        creds = sign.Credentials(self.access_key, self.secret_key, self.token)
        return sign.signer(creds, self.region, self.endpoint, self.virtual_hosted, bucket, prefix, expires_s, now)
