"""Frozen pydantic models that cross layers (provision -> ops -> cli)."""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from gpuctl.model import untrusted
from gpuctl.model.specs import AnySpec, Frozen

# preempted: its spot instance was interrupted (the job stopped on the notice, or the instance is
# gone by EC2's word); recovery or `train --resume` continues it from its checkpoint.
# queued: its job waits on the instance for its GPUs (the cluster's queue, ops/queue.py).
RunState = Literal["starting", "queued", "running", "succeeded", "failed", "stopped", "lost", "preempted"]
FINAL_RUN_STATES = frozenset({"succeeded", "failed", "stopped", "lost", "preempted"})
RESUMABLE = ("failed", "stopped", "lost", "preempted")  # `train --resume` continues a run in these states


# An instance in these states is gone (its billing ended), whatever its provider.
ENDED_STATES = frozenset({"terminated", "shutting-down"})


class PriceQuote(Frozen):
    """What a launch is about to bill, as its provider prices it before anything is created."""

    usd_per_hour: float  # every node together
    nodes: int = 1
    market: str = "on-demand"
    source: str = ""  # where the price comes from ("spot price in us-east-1a", "local.usd_per_hour")
    max_price: Optional[float] = None  # spot: the cap in force per node, $/h
    cap_source: str = ""  # "--max-price" or "the on-demand price (AWS's default)"

    @property
    def worst_usd_per_hour(self) -> float:
        """The most the launch may bill an hour, every node together: spot's cap where one is in
        force (the price now may rise to it, or the launch land in a dearer zone), else the price."""
        if self.max_price is None:
            return self.usd_per_hour
        return max(self.usd_per_hour, self.max_price * self.nodes)


class InstanceRecord(Frozen):
    """One machine of a cluster as the provider reports it."""

    id: str
    node: int = 0  # its rank in a multi-node cluster (0 = the chief)
    cluster: str
    state: str
    public_ip: Optional[str] = None
    private_ip: Optional[str] = None
    zone: Optional[str] = None
    market: str = "on-demand"
    usd_per_hour: float = 0.0
    # The most it may be billed an hour (spot: its cap, the on-demand price unless --max-price);
    # None: usd_per_hour (or recorded before this was).
    max_usd_per_hour: Optional[float] = None
    launched_at: float
    terminated_at: Optional[float] = None
    # Where gpuctl keeps its files on that machine (code, runs, payload).
    workdir: str
    region: Optional[str] = None
    instance_type: Optional[str] = None
    image_id: Optional[str] = None
    image_name: Optional[str] = None
    # Why that image: "baked" (this owner's, with TF), "dlami" (AWS's TF DLAMI), "base" (driver and
    # CUDA only: the setup step installs TF), "pinned" (--image).
    image_kind: Optional[str] = None
    price_source: Optional[str] = None
    ssh_user: Optional[str] = None
    key_path: Optional[str] = None
    port: Optional[int] = None
    # ssh provider: the jump hosts on the way ("user@host:port", the first reached directly), as the
    # ssh config resolved them at `up`, and the key each logs in with ("" = ssh-agent and ~/.ssh keys).
    jump_hosts: tuple[str, ...] = ()
    jump_keys: tuple[str, ...] = ()
    # gpuctl's tmux server on the host (`tmux -L`). "gpuctl" is what every cluster used before
    # clusters on one host got their own; an ssh cluster's is unique to its `up`.
    tmux_socket: str = "gpuctl"
    state_reason: Optional[str] = None  # why it stopped or ended, as the provider says
    # (since, $/h) steps of its price over its life: spot prices change; one step otherwise.
    price_steps: tuple[tuple[float, float], ...] = ()
    on_demand_usd_per_hour: Optional[float] = None  # what on-demand would cost, for spot savings
    # (start, end) of each running period, end None while running; empty = launched_at until terminated_at.
    periods: tuple[tuple[float, Optional[float]], ...] = ()


class Resource(Frozen):
    """Something a provider created for gpuctl, found by its tags (or files), not by memory."""

    provider: str
    kind: str  # instance | security-group | key-pair | workdir
    id: str
    region: Optional[str] = None
    cluster: Optional[str] = None
    state: Optional[str] = None


class ClusterRecord(Frozen):
    """One `up` of a cluster. The id is its identity: names are the handle users type and are
    reused after `down`; instances, runs and events hang off the id."""

    id: int
    name: str
    provider: str
    state: Literal["up", "down"]
    created_at: float
    terminated_at: Optional[float] = None
    is_default: bool = False
    spec: AnySpec  # the provider's own spec class, by its `provider`


class Segment(Frozen):
    """One stretch of a run on one instance; a resume or a recovery starts the next one."""

    instance_id: str  # the chief's, on several nodes
    node_ids: tuple[str, ...] = ()  # the other nodes' instances, by rank (1, 2, ...)
    zone: Optional[str] = None
    market: str = "on-demand"
    usd_per_hour: float = 0.0
    started_at: float
    ended_at: Optional[float] = None
    end: Optional[str] = None  # why it ended: a final run state (preempted, lost, failed, ...)
    # The queue wait its start was moved past (once: None until the instance's queue said it started).
    queued_s: Optional[float] = None

    @property
    def instance_ids(self) -> tuple[str, ...]:
        """Every node's instance, by rank (the chief's first)."""
        return (self.instance_id, *self.node_ids)


class CodeVersion(Frozen):
    """The code a run was submitted with (ops/provenance.py): a hash of the files pushed (path and
    content, 12 hex), the git commit of the checkout it came from, if any, and whether what was
    pushed differs from that commit (ops/gitstate.py; None: not known)."""

    hash: str
    commit: Optional[str] = None
    dirty: Optional[bool] = None


class RunRecord(Frozen):
    run_id: str
    cluster: str  # the cluster's name, for display
    cluster_id: int = 0  # the cluster it ran on (the ledger fills it from its own column)
    project: str
    entry: str
    args: tuple[str, ...] = ()
    state: RunState
    started_at: float
    ended_at: Optional[float] = None
    exit_code: Optional[int] = None
    epochs_planned: Optional[int] = None
    usd_per_hour: float = 0.0
    run_dir: str
    tf_log_level: int = 2  # TF_CPP_MIN_LOG_LEVEL it ran with: what `logs` hides of TensorFlow's start-up
    budget_usd: float = 0.0  # its own budget (its epochs' dollars; train --budget); 0 = none
    env_names: tuple[str, ...] = ()  # passed with `train --env NAME`: the names only, never the values
    tensorflow: Optional[str] = None  # the version the run's Python imported (preflight), None on local
    image: Optional[str] = None  # the image its instance booted ("name (ami-...)"), None on hosts gpuctl did not launch
    resumed_at: Optional[float] = None  # the last `train --resume` (its job's times count from here)
    resumes: int = 0
    data: Optional[str] = None  # the data directory pushed with it (`train --data`), pushed again on a new instance,
    # or the S3 data set (s3://...) each node fetched, fetched again there
    # An S3 data set's fetch on the chief when the run was (last) submitted: its seconds (the GPU
    # waited for them: `cost` counts them) and the bytes it fetched (0: all cached).
    data_fetch_s: Optional[float] = None
    data_fetch_bytes: Optional[int] = None
    code: Optional[CodeVersion] = None  # the code it was (last) submitted with; None: recorded before
    # The project's requirements file installed for it ("requirements.txt (sha256 1a2b3c4d)"), and the
    # seconds its install took on the slowest node (0: made by an earlier run); None: it had none.
    packages: Optional[str] = None
    packages_s: Optional[float] = None
    segments: tuple[Segment, ...] = ()  # where it ran, oldest first (empty for runs recorded before segments)
    # A multi-node run (MultiWorkerMirroredStrategy): how many nodes, each node's last known state,
    # and the node whose failure ended it.
    nodes: int = 1
    node_states: tuple[str, ...] = ()
    failed_node: Optional[int] = None
    # Several nodes: how long its job may take to start on every node (train.start_timeout_s; 0:
    # recorded before this deadline, none) and the nodes where it did not (the run then failed).
    start_timeout_s: float = 0.0
    not_started: tuple[int, ...] = ()
    # The cluster's queue: the GPUs (slots) it asked for on each node (0: recorded before the
    # queue), `train --now`, its place while queued (1 = next), and the instance's start time of
    # the queue wait already counted (its started_at moved past the wait once).
    gpus: int = 0
    now: bool = False
    queue_position: Optional[int] = None
    queue_started: Optional[float] = None
    # Bytes of the chief's epochs.jsonl already ingested, and from which instance and directory:
    # each look reads only what is new (the file is the instance's, and may be huge).
    epochs_read: int = 0
    epochs_source: str = ""


# Epochs of one run gpuctl keeps: a report of a later epoch is not believed (the instance writes
# them, and every report is held in memory by `cost`).
MAX_EPOCHS = 10_000
MAX_METRICS = 64  # metrics of one epoch kept (by name order); the rest are dropped


class EpochReport(Frozen):
    """One line of the payload's epochs.jsonl: the cost and speed of one finished epoch. Written
    on the instance, so every field is bounded (model/untrusted.py): a line that fails is not ingested,
    and a row stored before the bounds existed is skipped when the ledger reads it."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False, defer_build=True)

    schema_version: int = Field(alias="schema", ge=0, le=1000)
    run_id: untrusted.Short
    epoch: int = Field(ge=1, le=MAX_EPOCHS)
    epochs_planned: Optional[int] = Field(default=None, ge=1, le=MAX_EPOCHS)
    start: untrusted.Stamp
    end: untrusted.Stamp
    seconds: untrusted.Seconds
    examples: Optional[untrusted.Count] = None
    examples_estimated: bool = False
    examples_per_s: Optional[float] = Field(default=None, ge=0, le=1e15)
    usd_per_hour: untrusted.Usd
    epoch_cost_usd: untrusted.Usd
    cumulative_usd: untrusted.Usd
    metrics: dict[str, Any] = {}
    # What nvidia-smi said while the epoch ran (the payload's samples); None where it said nothing
    # (no GPU, no nvidia-smi, an epoch shorter than the sampling interval) or nothing believable.
    gpu_util_percent: Optional[float] = None  # mean over the samples and the run's GPUs
    gpu_memory_used_mib: Optional[float] = None  # the peak, all the run's GPUs together
    gpu_memory_total_mib: Optional[float] = None
    gpu_samples: Optional[int] = None

    @field_validator("gpu_util_percent", "gpu_memory_used_mib", "gpu_memory_total_mib", "gpu_samples", mode="before")
    @classmethod
    def _reading_or_none(cls, v: Any, info: Any) -> Any:
        """The instance's figures are untrusted: one out of bounds becomes None rather than costing
        the whole epoch its report."""
        high = {"gpu_util_percent": 100.0, "gpu_samples": 1e7}.get(info.field_name, 1e7)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= high:
            return None
        return int(v) if info.field_name == "gpu_samples" else float(v)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> dict[str, Any]:
        """Numbers by short printable names; anything else of the instance's is dropped, not refused."""
        if not isinstance(value, dict):
            return {}
        kept = {}
        for name, number in sorted(value.items(), key=lambda kv: str(kv[0]))[:MAX_METRICS]:
            name = untrusted.one_line(name, 64) if isinstance(name, str) else ""
            if name and (number is None or untrusted.optional(number, (int, float), -1e300, 1e300) is not None):
                kept[name] = number
        return kept


class SettingValue(Frozen):
    key: str
    value: Any
    source: str


class SyncStats(Frozen):
    files_total: int
    files_copied: int
    bytes_copied: int
    files_deleted: int
    seconds: float
    skipped: tuple[str, ...] = ()  # "path: why" for each link or special file not pushed (sync.scan)
    refused: tuple[str, ...] = ()  # "path: what" for each private entry never pushed (sync/private.py)


class CommandResult(Frozen):
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    dropped: int = 0  # bytes of output read and not kept (past the caller's limit: remote/host.py MAX_OUTPUT)
