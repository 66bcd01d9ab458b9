"""What a user asked a command for, as one frozen record the CLI builds and the use case reads
(instead of parameter lists that grow with every flag): `train`'s and `up`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import ConfigDict

from gpuctl.model.specs import Frozen


class TrainRequest(Frozen):
    """`gpuctl train PROJECT`: what to run, where, and how (ops/runs.py `train`)."""

    project: Path
    cluster: Optional[str] = None  # None: the default cluster
    args: tuple[str, ...] = ()  # the script's own arguments (recorded in the ledger)
    data: Optional[Path] = None  # pushed apart from the code ($GPUCTL_DATA_DIR)
    data_url: Optional[str] = None  # `--data s3://BUCKET/PREFIX`: fetched by each node itself (ops/datasets.py)
    env_names: tuple[str, ...] = ()  # variables passed from here to the job; their values never recorded
    gpus: Optional[int] = None  # the GPUs of a node it waits for in the queue (None: all)
    now: bool = False  # start beside the runs there, without waiting
    allow_cpu: bool = False  # start where TensorFlow sees no GPU
    recheck: bool = False  # the preflight looks again, not the answer kept from before
    down_after_run: Optional[bool] = None  # None: guards.down_after_run
    stop_after: Optional[int] = None  # the run ends after that many epochs (a plan's probe)


class UpRequest(Frozen):
    """`gpuctl up`: the settings its flags set (None: not given, the settings hold) and how to
    launch (ops/clusters.py `up`)."""

    # A price or hours of inf or nan is refused by `up` itself, in its own words (ops/clusters.py).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=True, defer_build=True)

    name: Optional[str] = None
    provider: Optional[str] = None
    instance_type: Optional[str] = None
    market: Optional[Literal["spot", "on-demand"]] = None
    max_price: Optional[float] = None
    fallback_on_demand: Optional[bool] = None
    region: Optional[str] = None
    profile: Optional[str] = None
    image: Optional[str] = None
    tensorflow: Optional[str] = None
    disk_gb: Optional[int] = None
    ssh_cidr: Optional[str] = None
    max_hours: Optional[float] = None
    nodes: Optional[int] = None
    placement: Optional[str] = None
    hosts: tuple[str, ...] = ()
    identity: Optional[str] = None
    usd_per_hour: Optional[float] = None  # local/ssh: the price reports use
    zone: Optional[str] = None  # aws: the availability zone
    volume: Optional[str] = None  # a volume's name (`gpuctl volume create`): attached and mounted on the chief
    wait_ssh: bool = True  # False: return once the instances run
    make_default: bool = True  # False: a bake's or a plan's own cluster is nobody's default
    launched_for: str = ""  # the use case launching it for itself (ClusterSpec.launched_for)

    def flags(self) -> dict[str, Any]:
        """The settings these flags set, by setting name (the Session's flags)."""
        flags: dict[str, Any] = {
            "cluster": self.name, "provider": self.provider, "aws.instance_type": self.instance_type,
            "aws.market": self.market, "aws.max_price": self.max_price,
            "aws.fallback_on_demand": self.fallback_on_demand, "aws.region": self.region,
            "aws.profile": self.profile, "aws.image": self.image, "train.tensorflow": self.tensorflow,
            "aws.disk_gb": self.disk_gb, "aws.ssh_cidr": self.ssh_cidr, "guards.max_hours": self.max_hours,
            "ssh.hosts": list(self.hosts) or None, "ssh.identity": self.identity, "nodes": self.nodes,
            "aws.placement": self.placement, "aws.zone": self.zone,
        }
        if self.hosts and self.provider is None:
            flags["provider"] = "ssh"  # --host only makes sense for the ssh provider
        return flags
