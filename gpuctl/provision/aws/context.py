"""What the aws provider's parts share for one command: the gpuctl home, the cluster's spec, the
owner id its tags carry, and one boto3 session per region. The parts (baked images, the S3 store,
discover and release) take this, not the provider, so none of them imports the provider."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from gpuctl.model.specs import AwsSpec
from gpuctl.provision.aws import access
from gpuctl.provision.aws.session import Aws, call

LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


class AwsContext:
    def __init__(self, home: Path, spec: AwsSpec):
        self.home = Path(home)
        self.spec = spec
        self._owner: str | None = None
        self._sessions: dict[str, Aws] = {}
        self._sessions_lock = threading.Lock()

    @property
    def owner(self) -> str:
        """This machine's owner id (access.owner_id), read once."""
        if self._owner is None:
            self._owner = access.owner_id(self.home)
        return self._owner

    def aws(self, region: str | None = None) -> Aws:
        """A boto3 session for the region (the spec's by default) and the spec's profile: one per
        region for this command, so each client is made once, not once per call."""
        key = region or self.spec.region or ""
        with self._sessions_lock:
            if key not in self._sessions:
                self._sessions[key] = Aws(region=key, profile=self.spec.profile or "")
            return self._sessions[key]

    def live_instances(self, ec2: Any, cluster: str | None, every_owner: bool = False) -> list[dict[str, Any]]:
        """Instances tagged for this owner (or any) and cluster (or any) that are not terminated."""
        owner = None if every_owner else self.owner
        filters = access.owner_filters(owner, cluster) + [{"Name": "instance-state-name", "Values": LIVE_STATES}]
        res = call(ec2.describe_instances, Filters=filters)
        return [i for r in res.get("Reservations", []) for i in r.get("Instances", [])]
