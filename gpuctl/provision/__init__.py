"""The provider contract, and a lazy registry of its implementations.

A provider turns a ClusterSpec into instances, hands out a Host for each, and releases them.
Cloud specifics stay inside `provision/<provider>/`; nothing above this package sees boto3.
The registry maps names to import paths so that listing providers (settings validation,
`--help`) imports no provider module and none of its heavy dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from gpuctl.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable

    from gpuctl.remote.host import Host
    from gpuctl.settings import Settings
    from gpuctl.types import ClusterSpec, InstanceRecord, Resource

PROVIDERS: dict[str, str] = {
    "aws": "gpuctl.provision.aws:AwsProvider",
    "local": "gpuctl.provision.local:LocalProvider",
    "ssh": "gpuctl.provision.ssh:SshProvider",
}


class Provider(Protocol):
    name: str
    # True: `up` on a live cluster finds its instances (by tag) and reuses them.
    # False: a live name is a conflict.
    reuses_live_clusters: bool

    def launch(self, spec: "ClusterSpec", progress: "Callable[[str], None]", wait_ssh: bool = True) -> "list[InstanceRecord]":
        """Create the cluster's instances, or find and reuse them, and return them."""

    def host(self, instance: "InstanceRecord", connect_timeout_s: float | None = None) -> "Host":
        """A Host to run commands and move files on this instance (connect within the timeout)."""

    def discover(self, cluster: str | None = None, region: str | None = None) -> "list[Resource]":
        """Everything this provider created for gpuctl (for one cluster, or all), found afresh."""

    def release(self, resources: "list[Resource]", progress: "Callable[[str], None]") -> None:
        """Delete the resources; already-gone ones are fine."""


def get_provider(name: str, home: "Path", settings: "Settings") -> Provider:
    """Instantiate the provider registered under `name` (imports its module only now)."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown provider {name!r}", f"Known providers: {', '.join(sorted(PROVIDERS))}."
        ) from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(home, settings)
