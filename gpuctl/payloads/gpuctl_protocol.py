"""The files gpuctl's client and its payloads exchange: one typed contract. Stdlib only; Python 3.8+.

The client builds these records and writes `to_json()`; the payloads (which import this by bare
name: it is pushed with them) read them with `load` / `from_dict`, which never raise: a missing
key or a bad value (wrong type, not finite, out of bounds) takes the default (but a deadline that
is there and unreadable takes one long past: its guard fires), an unknown key (a newer client's)
is ignored. JSON keys are the field names and keep their meaning: older payloads
still running on an instance meet newer clients. This file rides in the aws user data with the
watchdog (WATCHDOG_FILES), without its comments (provision/aws/shipped.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable, Dict, Final, Optional, Type, TypeVar

# "schema" of each line of a run's epochs.jsonl (gpuctl.model.records.EpochReport).
EPOCH_SCHEMA_VERSION = 1

RUN_CONFIG_FILE = "run.json"  # in the run's dir
# The run's own copy of its data set, in the run's dir (linked there when it is submitted): never
# sent to the store or pulled back (it can be many GB; it came from this machine or a bucket).
RUN_DATA_DIR = "data"
NOTICE_FILE = "notice.json"  # in the guard dir: a spot interruption, once the watchdog heard it
# In the run's dir: the job's exit code (its script writes it; the watchdog, for a pane that died
# without), its place in the node's queue, and the rank of the node whose job started there.
EXIT_CODE_FILE, QUEUE_FILE, NODE_STARTED_FILE = "exitcode", "queue.json", "node-started"
# In the run's dir: written by `stop` and `down` before their SIGTERM, which a job just starting can
# lose (its script's fork still carries the script's trap); the launcher looks for it once its own
# handler is in place, so one of the two always reaches it.
STOP_FILE = "stop-requested"

# Stopped by a spot interruption notice (EX_TEMPFAIL: again later, elsewhere) at a batch end, its
# last whole epoch checkpointed; only with PREEMPTED_MARK in its run dir (a script may exit 75 itself).
# How long nvidia-smi may take to answer, on either side (the client's GPU count, the watchdog's
# look at their use): a healthy one answers within seconds; a hung one means the GPUs are unknown.
NVIDIA_SMI_S = 10
PREEMPTED_EXIT = 75
PREEMPTED_MARK = "preempted.json"
STOPPED_EXIT = 143  # 128 + SIGTERM: stopped gracefully (by `stop`, `down` or a guard), or dequeued

# What a guard's firing does (`on_fire`); Final: their types are these very strings.
POWEROFF: Final = "poweroff"
STOP_JOBS: Final = "stop-jobs"

# The watchdog's code, entry point first: in the aws user data (it runs from boot), and hashed by
# both sides (a changed hash restarts it).
WATCHDOG_FILES = ("gpuctl_watchdog.py", "gpuctl_decide.py", "gpuctl_logins.py", "gpuctl_notice.py",
                  "gpuctl_nbwatch.py", "gpuctl_protocol.py")

_BAD = object()
Json = Any  # a value json.loads returned: read with the checks below


def _number(value: Json) -> Json:
    if isinstance(value, bool):  # an int to Python, never a number here
        return _BAD
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        return _BAD
    return f if math.isfinite(f) else _BAD


def _integer(value: Json) -> Json:
    f = _number(value)
    return _BAD if f is _BAD or f != int(f) else int(f)


def _of(kind: type) -> Callable[[Json], Json]:
    return lambda value: value if isinstance(value, kind) else _BAD


_KINDS: Dict[str, Callable[[Json], Json]] = {
    "float": _number, "int": _integer, "bool": _of(bool), "str": _of(str), "Dict[str, Any]": _of(dict)}


def _accept(f: Field[Any], value: Json) -> Json:
    kind = str(f.type)  # a string (`from __future__ import annotations`)
    if kind.startswith("Optional["):
        if value is None:
            return None
        kind = kind[len("Optional["):-1]
    record = _RECORDS.get(kind)
    if record is not None:
        return record.from_dict(value) if isinstance(value, dict) else _BAD
    got = _KINDS[kind](value)
    meta = f.metadata
    if got is _BAD or ("choices" in meta and got not in meta["choices"]) or ("min" in meta and got < meta["min"]):
        return _BAD
    return got


R = TypeVar("R", bound="Record")


@dataclass
class Record(object):
    """Read leniently, written whole."""

    @classmethod
    def from_dict(cls: Type[R], data: Json) -> R:
        """The record from parsed JSON: defaults for what is missing or bad."""
        values: Dict[str, Json] = {}
        if isinstance(data, dict):
            for f in fields(cls):
                if f.name in data:
                    got = _accept(f, data[f.name])
                    if got is not _BAD:
                        values[f.name] = got
                    elif "bad" in f.metadata:  # a limit that is there but unreadable: fire, never off
                        values[f.name] = f.metadata["bad"]
        return cls(**values)

    @classmethod
    def load(cls: Type[R], path: str) -> R:
        """The record in a JSON file; all defaults if it is missing or no JSON."""
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError, RecursionError):
            data = None
        return cls.from_dict(data)

    def to_dict(self) -> Dict[str, Json]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


@dataclass
class QueueConfig(Record):
    """run.json's `queue`: the run waits for `want` of the node's `slots` (its GPUs; 1 without)."""

    dir: str = ""
    want: int = field(default=1, metadata={"min": 1})
    slots: int = field(default=1, metadata={"min": 1})
    gpus: int = field(default=0, metadata={"min": 0})
    now: bool = False  # `train --now`
    node_usd_per_hour: Optional[float] = None  # the run costs its share of it; None: its own rate


@dataclass
class StoreConfig(Record):
    """run.json's `store`: where the run's files outlive the instance (gpuctl_store checks target)."""

    target: Optional[Dict[str, Any]] = None
    key_prefix: str = ""
    imds_endpoint: Optional[str] = None
    read_only: bool = False  # a node other than the chief: restores, never writes


@dataclass
class RunConfig(Record):
    """RUN_DIR/run.json (gpuctl.ops.stages.configure); the defaults are a run off gpuctl."""

    run_id: str = "local"
    entry: str = ""
    usd_per_hour: float = field(default=0.0, metadata={"min": 0})
    budget_usd: float = field(default=0.0, metadata={"min": 0})  # its epochs' dollars; 0 = no cap
    mixed_precision: str = field(default="auto", metadata={"choices": ("auto", "on", "off")})
    memory_growth: bool = True
    gpu_sample_s: float = 0.0  # 0 = no nvidia-smi
    stop_after_epochs: Optional[int] = field(default=None, metadata={"min": 1})  # a plan's probe
    report_path: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    notice_file: Optional[str] = None  # a spot notice there makes a SIGTERM a preemption
    store: Optional[StoreConfig] = None
    resumed: bool = False
    queue: Optional[QueueConfig] = None  # None: starts at once
    # The run's own code (its job's working directory) and data, linked from the pushed trees when
    # it was submitted, and the code's content hash (gpuctl.ops.provenance): what this run ran.
    code_dir: Optional[str] = None
    data_dir: Optional[str] = None
    code_hash: Optional[str] = None


@dataclass
class GuardConfig(Record):
    """GUARD_DIR/config.json (gpuctl.ops.guards; the aws user data at boot). A limit it lacks is
    off: the watchdog never invents one (the user's defaults are the settings')."""

    idle_s: float = 0.0
    idle_warn_s: float = 300.0  # a notebook server open: its users are warned this long before idle fires
    stall_s: float = 0.0
    on_stall: str = field(default="warn", metadata={"choices": ("warn", "fire")})
    grace_s: float = 120.0  # a stopped job's time to checkpoint; a run's end to run-done
    check_interval_s: float = 60.0
    gpu_idle_percent: float = 5.0
    budget_usd: float = 0.0  # 0 = no cap
    down_after_run: bool = False
    down_after_run_since: Optional[float] = field(default=None, metadata={"bad": 0.0})  # runs ended after it count
    on_fire: str = field(default=STOP_JOBS, metadata={"choices": (POWEROFF, STOP_JOBS)})
    poweroff_command: str = "sudo shutdown -h now"
    hard_cap_at: Optional[float] = field(default=None, metadata={"bad": 1.0})  # 1970: long past
    runs_dir: str = ""
    tmux_socket: str = "gpuctl"
    usd_per_hour: float = 0.0  # all the cluster's nodes'
    started_at: Optional[float] = None  # None: nothing spent yet
    cluster: Optional[str] = None
    cluster_key: Optional[str] = None  # this very `up`
    heartbeat_stale_s: float = 20.0
    notice: Optional[Dict[str, Any]] = None  # {"endpoint", "interval_s"} of spot notices
    boot_guard: bool = False


_RECORDS: Dict[str, Type[Record]] = {"QueueConfig": QueueConfig, "StoreConfig": StoreConfig}
