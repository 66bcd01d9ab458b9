"""Test seams: the only places where the test suite changes what gpuctl does. Each is read here
alone, from an environment variable named GPUCTL_TEST_*, which settings never treat as a setting.
Nothing else in gpuctl may look at GPUCTL_TEST_* variables."""

from __future__ import annotations

import os

ENDPOINTS = "GPUCTL_TEST_ENDPOINTS"


def endpoint_override(ip: str) -> str | None:
    """Where to SSH instead of `ip`, from GPUCTL_TEST_ENDPOINTS="IP=HOST[:PORT],..." (IP may be *).

    moto's instances have made-up IP addresses; the end-to-end tests map them to real sshd test
    hosts. Unset (always, outside the tests), every instance is reached at its own address."""
    target = None
    for pair in filter(None, os.environ.get(ENDPOINTS, "").split(",")):
        key, _, value = pair.partition("=")
        if key in (ip, "*"):
            target = value
    return target
