"""Frozen pydantic models that the use cases (gpuctl/ops/) return and the CLI renders."""

from __future__ import annotations

from typing import Any, Literal, Optional

from gpuctl.model.records import (ClusterRecord, CodeVersion, InstanceRecord, PriceQuote, Resource, RunRecord,
                                  RunState, Segment, SyncStats)
from gpuctl.model.data import FetchStats
from gpuctl.model.specs import Frozen, RunFiles


class TfEnv(Frozen):
    """The Python (and TensorFlow) a host's runs use, and how gpuctl came by it."""

    host: str
    python: str
    # remote.python: as set, nothing checked or installed; ready: gpuctl's env, made earlier (or
    # baked into the image); found: an image's own TF of that version (a DLAMI); installed: by
    # the setup step just now; local: this machine's own Python.
    how: Literal["remote.python", "ready", "found", "installed", "local"]
    tensorflow: Optional[str] = None  # the version installed (or imported, with the preflight)
    seconds: float = 0.0  # the install's time, when it ran
    report: Optional[dict[str, Any]] = None  # the preflight's JSON, when it ran


class UpResult(Frozen):
    cluster: ClusterRecord
    instances: tuple[InstanceRecord, ...]
    reused: bool = False
    tensorflow: tuple[TfEnv, ...] = ()  # what each host's runs will use (empty: found at the first train)


class TrainResult(Frozen):
    run: RunRecord
    code_sync: SyncStats
    data_sync: Optional[SyncStats] = None
    data_fetch: Optional[FetchStats] = None  # an S3 data set, as the chief fetched it
    session: str
    host: str = "local"
    node_gpus: Optional[int] = None  # the chief node's GPUs (0: none, one slot), as the queue counts them


class SyncResult(Frozen):
    code: SyncStats
    data: Optional[SyncStats] = None
    code_dir: str
    data_dir: Optional[str] = None


class PullResult(Frozen):
    run_id: str
    dest: str
    files: int
    skipped: tuple[str, ...] = ()  # what the instance listed that would have left `dest` (remote/sync/pull.py)
    left_out: tuple[str, ...] = ()  # the run's own copy of its data set ("data/"): never pulled back


class ExecResult(Frozen):
    host: str
    returncode: int
    stdout: str
    stderr: str


class ClusterCost(Frozen):
    id: int = 0
    name: str
    provider: str
    state: str
    uptime_s: float
    usd_per_hour: float
    usd: float  # compute + storage
    compute_usd: float = 0.0
    storage_usd: float = 0.0
    spot_savings_usd: Optional[float] = None  # against the on-demand price of the same type
    idle_usd: Optional[float] = None  # uptime dollars not spent in epochs


class ClusterStatus(ClusterCost):
    is_default: bool
    instances: int
    guard: Optional[dict[str, Any]] = None  # the watchdog's latest state.json
    note: Optional[str] = None  # e.g. why its instances ended
    setup_failed: Optional[str] = None  # why its last setup step failed (`gpuctl up` again retries it)


class SegmentCost(Segment):
    """A run's stretch on one instance, as the reports show it."""

    seconds: float = 0.0
    usd: float = 0.0  # what the instance cost while the run was on it (0 where EC2 does not bill it)
    free: bool = False  # a spot instance EC2 interrupted in its first hour: not billed (model/billing.py)
    lost_s: float = 0.0  # work after the last checkpointed epoch, done again on the next instance
    lost_usd: float = 0.0
    waited_s: float = 0.0  # from the end of the stretch before it to its start (a recovery's wait)


class RunStatus(Frozen):
    run_id: str
    cluster: str
    state: RunState
    exit_code: Optional[int] = None
    epoch: int = 0
    epochs_planned: Optional[int] = None
    metrics: dict[str, Any] = {}
    elapsed_s: float
    usd: float
    log_tail: Optional[str] = None  # last lines of the log, for failed and lost runs
    tensorflow: Optional[str] = None
    image: Optional[str] = None
    resumable: bool = False  # failed, stopped or lost, on a cluster still up: `train --resume` may continue it
    segments: tuple[SegmentCost, ...] = ()  # where it ran (more than one after a resume or a recovery)
    node_states: tuple[str, ...] = ()  # a multi-node run: each node's state, node 0 first
    failed_node: Optional[int] = None
    queue_position: Optional[int] = None  # queued: its place in the cluster's queue (1 = next)
    usd_per_hour: float = 0.0  # its share of its nodes' rate (GPUs held / a node's GPUs)
    code: Optional[CodeVersion] = None  # the code it was submitted with (ops/provenance.py)
    packages: Optional[str] = None  # RunRecord's: the requirements file installed for it
    packages_s: Optional[float] = None
    data: Optional[str] = None  # RunRecord's: its --data (a directory here, or s3://...)
    data_fetch_s: Optional[float] = None  # an S3 data set's fetch on the chief (RunRecord's)
    data_fetch_bytes: Optional[int] = None


class NotebookSession(Frozen):
    """A `gpuctl notebook` server's time on its cluster (ops/notebook.py), at the cluster's rate."""

    cluster: str
    cluster_id: int
    started_at: float
    ended_at: Optional[float] = None  # None: it is open now
    seconds: float
    usd_per_hour: float
    usd: float


class StatusReport(Frozen):
    clusters: tuple[ClusterStatus, ...]
    runs: tuple[RunStatus, ...]
    notebooks: tuple[NotebookSession, ...] = ()  # beside the runs: a notebook's time is spend too
    hidden_clusters: int = 0  # released more than a week ago, left out (`status --all` shows them)
    notes: tuple[str, ...] = ()  # what the instances sent that was not believed (a report line, a state file)


class EpochRow(Frozen):
    epoch: int
    seconds: float
    examples: Optional[int] = None
    examples_per_s: Optional[float] = None
    epoch_cost_usd: float
    cumulative_usd: float
    metrics: dict[str, Any] = {}
    gpu_util_percent: Optional[float] = None  # as the payload sampled nvidia-smi (None: no reading)
    gpu_memory_used_mib: Optional[float] = None


class RunCost(Frozen):
    run_id: str
    cluster: str
    state: RunState
    instance_type: Optional[str] = None
    market: Optional[str] = None
    usd_per_hour: float
    epochs_done: int
    epochs_planned: Optional[int] = None
    epochs: tuple[EpochRow, ...]
    mean_epoch_s: Optional[float] = None
    mean_epoch_usd: Optional[float] = None
    spent_usd: float
    # "epochs": spent_usd is its reported epochs' dollars; "wall time": it reported none, so they
    # are its whole time on its instances (wall_s) at their $/h.
    spent_from: Literal["epochs", "wall time"] = "epochs"
    wall_s: Optional[float] = None
    projected_remaining_usd: Optional[float] = None
    projected_total_usd: Optional[float] = None
    examples_per_s: Optional[float] = None  # mean over the epochs
    usd_per_million_examples: Optional[float] = None
    projected_finish_at: Optional[float] = None  # when the planned epochs would be done
    tensorflow: Optional[str] = None
    image: Optional[str] = None
    code: Optional[CodeVersion] = None  # the code it was submitted with (ops/provenance.py)
    segments: tuple[SegmentCost, ...] = ()
    instances_usd: Optional[float] = None  # every instance it used, while it was on them
    lost_s: float = 0.0  # work done again after interruptions (cut epochs), and its dollars
    lost_usd: float = 0.0
    waited_s: float = 0.0  # between instances (recovery)
    # An S3 data set's fetch before the run started (the GPU waited for it), at the run's $/h.
    data_fetch_s: Optional[float] = None
    data_fetch_usd: Optional[float] = None


class CostReport(Frozen):
    clusters: tuple[ClusterCost, ...]
    runs: tuple[RunCost, ...]
    notebooks: tuple[NotebookSession, ...] = ()
    total_usd: float
    notes: tuple[str, ...] = ()  # what the instances sent that was not believed


class StopResult(Frozen):
    """`gpuctl stop`: the runs it stopped (SIGTERM, then SIGKILL after `grace_s`), and a named run
    that had already ended (nothing done to it). The cluster stays up."""

    cluster: str
    grace_s: float
    stopped: tuple[RunRecord, ...] = ()
    already_ended: Optional[RunRecord] = None
    dequeued: tuple[str, ...] = ()  # of the stopped runs, those taken out of the queue before they started


class LaunchQuestion(Frozen):
    """What `up` asks before it starts what bills (cli/render/questions.py says it)."""

    cluster: str
    provider: str
    nodes: int
    instance_type: Optional[str] = None  # the type asked for, where the provider picks types (aws)
    market: Optional[str] = None  # "spot" or "on-demand" there
    quote: PriceQuote  # what the launch bills an hour, all nodes together
    max_hours: float  # the hard cap
    budget_usd: float = 0.0  # guards.budget_usd (0: none)


class DownQuestion(Frozen):
    """What `down` asks before it releases a live cluster (cli/render/questions.py says it)."""

    cluster: str
    files: Optional[RunFiles] = None  # None: no live cluster of that name
    unpulled: tuple[str, ...] = ()  # runs whose files exist only on the instance (oldest first)


class Kept(Frozen):
    """What `down --all` leaves because it holds data (a volume, a data set in S3), with what it
    costs while it stays and the command that deletes it."""

    kind: Literal["volume", "data set"]
    name: str
    size: str  # as people read it: "3 GB", "1.2 GB"
    usd_per_month: float
    remove: str  # e.g. "gpuctl volume rm NAME"


class DownResult(Frozen):
    cluster: str
    already_down: bool = False
    stopped_runs: tuple[str, ...] = ()
    released_instances: tuple[str, ...] = ()
    released: tuple[Resource, ...] = ()
    pulled: tuple[str, ...] = ()  # `down --pull`: the runs brought back before the release
    # Runs whose jobs could not be confirmed stopped before the release (a host that hung or did
    # not answer), and why: the release ends what runs there (on ssh, where the host answers).
    unconfirmed_runs: tuple[str, ...] = ()
    unconfirmed_why: Optional[str] = None
    # What the ledger could not take (a full or read-only disk): released all the same.
    unrecorded: tuple[str, ...] = ()
    kept: tuple[Kept, ...] = ()  # `down --all`: the volumes and data sets it leaves (they hold data)


class Inventory(Frozen):
    """`status --all`: every resource each provider can find, and what the ledger knows of it."""

    resources: tuple[Resource, ...]
    ledger_clusters: tuple[str, ...]  # live clusters in the ledger
    notes: tuple[str, ...] = ()  # providers that could not be searched, and why


class StatusAll(Inventory):
    """`status --all`: everything: every cluster and run of the ledger (those released long ago
    too), then every resource each provider finds, ledger or not."""

    clusters: tuple[ClusterStatus, ...] = ()
    runs: tuple[RunStatus, ...] = ()


class SshConfigResult(Frozen):
    path: str
    hosts: tuple[str, ...]
    included_from: Optional[str] = None


class GuardCheck(Frozen):
    """One dry look by the watchdog's own code on one host (`guard show --check`): what it sees,
    what it would decide now, and whether what firing needs is there. As the host reports it."""
    host: str
    result: dict[str, Any]


class GuardReport(Frozen):
    cluster: str
    config: dict[str, Any]
    state: dict[str, Any]
    # Budgets of the cluster's live runs (train --budget), beside the cluster's uptime budget.
    run_budgets: dict[str, float] = {}
    checks: tuple[GuardCheck, ...] = ()
    notes: tuple[str, ...] = ()  # what of the instance's guard files was not believed, and why


# ok: measured and projected; failed: the launch or the run failed (`problem` says how: the error,
# or the last line of its log); timed out: stopped after --probe-timeout; cancelled: Ctrl-C; no
# epochs: the script ran but reported none (a custom loop without gpuctl_report's API); no
# reading: its epochs' times are not believable (0 s, or over a week), so nothing is projected.
ProbeOutcome = Literal["ok", "failed", "timed out", "cancelled", "no epochs", "no reading"]


class PlanRow(Frozen):
    """One machine `gpuctl plan` measured (a probe cluster of a type, a cluster that was up, or a
    past run with --from-history), and what `--epochs N` would take on it."""

    label: str  # "g5.xlarge spot", "cluster lab", as the table names it
    source: Literal["type", "cluster", "history"]
    cluster: str
    provider: str
    instance_type: Optional[str] = None
    market: Optional[str] = None
    run_id: Optional[str] = None
    run_started_at: Optional[float] = None  # history: when that run ran
    outcome: ProbeOutcome = "ok"
    problem: Optional[str] = None  # one line, printable
    usd_per_hour: float = 0.0  # what the probe's run was billed at (the zone's spot price it got)
    ready_s: Optional[float] = None  # launch, setup, push and the script's start-up, to its first epoch
    first_epoch_s: Optional[float] = None  # compilation and warm-up included
    steady_epoch_s: Optional[float] = None  # the mean of the epochs after the first
    steady_epochs: int = 0  # how many (0: the first epoch stands for them)
    examples_per_s: Optional[float] = None  # in the steady epochs
    gpu_util_percent: Optional[float] = None  # in the steady epochs; None: no nvidia-smi reading
    gpu_memory_used_mib: Optional[float] = None
    gpu_memory_total_mib: Optional[float] = None
    projected_s: Optional[float] = None  # ready + first + (N-1) x steady
    projected_usd: Optional[float] = None
    probe_usd: float = 0.0  # what measuring it cost (its cluster, or its run's time on a cluster that was up)
    rank: Optional[int] = None  # 1 = cheapest
    fastest: bool = False
    released: bool = True  # False: its probe cluster could not be released and still bills (`problem` says how)


class PlanReport(Frozen):
    project: str
    epochs: int  # --epochs N, what the projection is for
    probe_epochs: int
    rows: tuple[PlanRow, ...]  # ranked by projected dollars; rows that measured nothing last
    recommendation: Optional[str] = None  # the command that runs the cheapest
    plan_usd: float = 0.0  # what the plan's probes cost
    worst_case_usd: float = 0.0  # what it could have cost (each probe's $/h x its hard cap)
    notes: tuple[str, ...] = ()  # hints: an input-bound GPU, a steady epoch taken from the first
