"""Test seams: the only places where the test suite changes what gpuctl does. Each is read here
alone, from an environment variable named GPUCTL_TEST_*, which settings never treat as a setting.
Nothing else in gpuctl may look at GPUCTL_TEST_* variables."""

from __future__ import annotations

import os

ENDPOINTS = "GPUCTL_TEST_ENDPOINTS"


def endpoint_override(ip: str, node: int = 0, instance_type: str = "") -> str | None:
    """Where to SSH instead of `ip`, from GPUCTL_TEST_ENDPOINTS="KEY=HOST[:PORT],..." where KEY is
    an IP, `node:N` (the cluster's node of rank N), `type:T` (an instance of type T: `plan --type`
    launches one cluster per type at once) or `*`; the last match wins.

    moto's instances have made-up IP addresses; the end-to-end tests map them to real sshd test
    hosts. Unset (always, outside the tests), every instance is reached at its own address."""
    target = None
    keys = {ip, "*", f"node:{node}"} | ({f"type:{instance_type}"} if instance_type else set())
    for pair in filter(None, os.environ.get(ENDPOINTS, "").split(",")):
        key, _, value = pair.partition("=")
        if key in keys:
            target = value
    return target


S3_ENDPOINT = "GPUCTL_TEST_S3_ENDPOINT"


def s3_endpoint() -> str | None:
    """The S3 endpoint an instance is told to use, from GPUCTL_TEST_S3_ENDPOINT (e.g.
    http://10.251.1.1:PORT: the tests' moto server as an sshd test host reaches it).

    This side keeps boto3's own endpoint (AWS_ENDPOINT_URL in the tests). Unset (always, outside
    the tests), an instance uses AWS's own S3 endpoint of the bucket's region."""
    return os.environ.get(S3_ENDPOINT) or None


VOLUME_DEVICES = "GPUCTL_TEST_VOLUME_DEVICES"


def volume_devices(volume_id: str) -> list[str] | None:
    """Where the chief finds an attached volume's device instead of EC2's names, from
    GPUCTL_TEST_VOLUME_DEVICES="KEY=DEVICE,..." where KEY is a volume id or `*`; the last match wins.

    moto attaches no device; the end-to-end tests give the sshd test host a loop device. Unset
    (always, outside the tests), the device is looked for where EC2 puts it (aws/mount.py)."""
    found = None
    for pair in filter(None, os.environ.get(VOLUME_DEVICES, "").split(",")):
        key, _, value = pair.partition("=")
        if key in (volume_id, "*"):
            found = [value]
    return found
