"""An EC2 instance as the ledger keeps it, and the records of one launch: each node priced and
told (`launched`) the moment EC2 gives its id, before anything else can fail or be interrupted,
so what bills is in the ledger whatever happens next."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from gpuctl import seams
from gpuctl.model.endpoint import split_target
from gpuctl.model.records import InstanceRecord
from gpuctl.model.specs import AwsSpec
from gpuctl.provision.aws import access, catalog, images, nodes

# What a launched record keeps from the moment EC2 gave its id, whatever later descriptions say.
PRICE_FIELDS = ("price_steps", "on_demand_usd_per_hour", "max_usd_per_hour")
ROLLED_BACK = "ended by gpuctl: its zone had no room for every node"


def describe(home: Path, spec: AwsSpec, region: str, inst: dict[str, Any], usd: float | None, source: str,
             chosen: images.Chosen | None = None, node: int | None = None, market: str | None = None) -> InstanceRecord:
    """An instance as EC2 described it; `node` and `market` where the launch knows them (the
    answer to RunInstances may carry neither tags nor lifecycle)."""
    node = nodes.rank(inst) if node is None else node
    # Where the tests map an instance to a test host, its peers reach it at that host's address.
    mapped = seams.endpoint_override(inst.get("PublicIpAddress") or "", node, inst.get("InstanceType") or "")
    return InstanceRecord(
        id=inst["InstanceId"],
        node=node,
        cluster=spec.name,
        state=inst["State"]["Name"],
        public_ip=inst.get("PublicIpAddress"),
        private_ip=split_target(mapped)[1] if mapped else inst.get("PrivateIpAddress"),
        zone=inst.get("Placement", {}).get("AvailabilityZone"),
        market=market or ("spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand"),
        usd_per_hour=usd if usd is not None else 0.0,
        price_source=source,
        launched_at=inst["LaunchTime"].timestamp() if hasattr(inst.get("LaunchTime"), "timestamp") else time.time(),
        workdir=spec.remote.workdir,
        region=region,
        instance_type=inst.get("InstanceType"),
        image_id=inst.get("ImageId"),
        image_name=chosen.name if chosen else None,
        image_kind=chosen.kind if chosen else None,
        ssh_user=spec.ssh_user,
        key_path=str(access.key_path(home, spec.name, region)),
    )


class Launch:
    """The records of one launch. `price(zone, market)` is the node's ($/h, source), known before
    RunInstances (no lookup between EC2's answer and the record); `cap` the spot cap per node."""

    def __init__(self, home: Path, spec: AwsSpec, region: str, chosen: images.Chosen,
                 price: Callable[[str, str], tuple[float, str]], cap: float | None,
                 launched: Callable[[InstanceRecord], None]):
        self.home, self.spec, self.region, self.chosen = home, spec, region, chosen
        self.price, self.cap, self.launched = price, cap, launched
        self.told: dict[str, InstanceRecord] = {}

    def _tell(self, record: InstanceRecord) -> InstanceRecord:
        self.told[record.id] = record
        self.launched(record)
        return record

    def made(self, inst: dict[str, Any], node: int, market: str) -> None:
        """EC2 answered RunInstances with this node: recorded at once, priced, with its cap."""
        usd, source = self.price(inst.get("Placement", {}).get("AvailabilityZone", ""), market)
        record = describe(self.home, self.spec, self.region, inst, usd, source, self.chosen, node, market)
        self._tell(record.model_copy(update={
            "price_steps": ((record.launched_at, usd),),
            "on_demand_usd_per_hour": usd if market == "on-demand" else catalog.ON_DEMAND_USD.get(self.spec.instance_type),
            "max_usd_per_hour": max(usd, self.cap or 0.0) if market == "spot" else usd,
        }))

    def ended(self, ids: list[str]) -> None:
        """Nodes of a zone given up, seen ended (nodes.launch_nodes waited for it)."""
        for iid in ids:
            if iid in self.told:
                self._tell(self.told[iid].model_copy(update={"state": "terminated", "terminated_at": time.time(),
                                                             "state_reason": ROLLED_BACK}))

    def running(self, insts: list[dict[str, Any]]) -> list[InstanceRecord]:
        """The nodes as EC2 describes them running (state, addresses), priced as at their launch."""
        out = []
        for inst in insts:
            first = self.told[inst["InstanceId"]]
            record = describe(self.home, self.spec, self.region, inst, first.usd_per_hour, first.price_source or "",
                              self.chosen, first.node, first.market)
            out.append(self._tell(record.model_copy(update={k: getattr(first, k) for k in PRICE_FIELDS})))
        return out
