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
    from gpuctl.remote.host import Host
    from gpuctl.settings import Settings
    from gpuctl.types import ClusterSpec, InstanceRecord

PROVIDERS: dict[str, str] = {
    "local": "gpuctl.provision.local:LocalProvider",
}


class Provider(Protocol):
    name: str

    def launch(self, spec: "ClusterSpec", settings: "Settings") -> "list[InstanceRecord]":
        """Create the cluster's instances (idempotent for an existing cluster) and return them."""

    def host(self, instance: "InstanceRecord") -> "Host":
        """A Host to run commands and move files on this instance."""

    def terminate(self, instances: "list[InstanceRecord]") -> None:
        """Release the instances and whatever gpuctl created for them; no error if already gone."""


def get_provider(name: str, home: "object") -> Provider:
    """Instantiate the provider registered under `name` (imports its module only now)."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown provider {name!r}", f"Known providers: {', '.join(sorted(PROVIDERS))}."
        ) from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(home)
