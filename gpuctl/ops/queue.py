"""The cluster's run queue, client side: how many GPUs a node has, what a run asks for, where a
run stands in the queue (read back from the instance, untrusted), and removing a queued run. The
queue itself runs on the instance (payloads/gpuctl_queue.py), so a closed laptop never stalls it."""

from __future__ import annotations

import posixpath
from typing import Any, Callable

from gpuctl.errors import ConfigError, GpuctlError
from gpuctl.model import untrusted
from gpuctl.model.records import RunRecord
from gpuctl.ops import guards
from gpuctl.payloads.gpuctl_protocol import NVIDIA_SMI_S, QUEUE_FILE, QueueConfig
from gpuctl.remote.host import PROBE_TIMED_OUT, Host, NodeFacts

PAYLOAD = "gpuctl_queue.py"
MAX_GPUS = 64  # more than any node has: a larger answer from the instance is not believed


def queue_dir(host: Host) -> str:
    return posixpath.join(host.root, "queue")


# How long nvidia-smi may take to list the GPUs. A driver that hangs is the GPU's trouble, not the
# host's: past this the GPUs are unknown (the run takes the node's one slot) and the host is asked
# on, where the host's own deadline would count it hung and fail the `train`.
PROBE_S = float(NVIDIA_SMI_S)


def gpus_of(host: Host, note: Callable[[str], None] | None = None, facts: NodeFacts | None = None) -> int:
    """The node's GPUs as nvidia-smi lists them; 0 where there is none (or no nvidia-smi), or
    where nvidia-smi does not answer within PROBE_S (then `note` hears so). With `facts` (what the
    host answered in this command), asked once per command."""
    if facts is None:
        count, why = _gpus(host)
    else:
        with facts.lock:
            if facts.gpus is None:
                facts.gpus = _gpus(host)
            count, why = facts.gpus
    if why and note is not None:
        note(why)
    return count


def _gpus(host: Host) -> tuple[int, str | None]:
    try:
        res = host.run(["nvidia-smi", "-L"], check=False, timeout=min(PROBE_S, host.command_timeout_s), probe=True)
    except (GpuctlError, OSError):  # no nvidia-smi on a CPU host: LocalHost raises where it is missing
        return 0, None
    if res.returncode == PROBE_TIMED_OUT:
        return 0, (f"nvidia-smi did not answer within {min(PROBE_S, host.command_timeout_s):g} s on {host.label}: "
                   "its GPUs are unknown, so the run takes the whole node (one slot)")
    if res.returncode != 0:
        return 0, None
    return min(MAX_GPUS, sum(1 for line in res.stdout.splitlines()[-MAX_GPUS - 1:] if line.startswith("GPU "))), None


def slots(gpus: int) -> int:
    """A node without GPU has one slot, so its runs still go one at a time."""
    return max(1, gpus)


def asked(gpus_flag: int | None, node_gpus: int, nodes: int) -> int:
    """The slots a run asks for (`train --gpus N`, default all of a node); bad input refused."""
    n = slots(node_gpus)
    if gpus_flag is None:
        return n
    if gpus_flag < 1:
        raise ConfigError(f"--gpus {gpus_flag}: a run needs at least one GPU", "Pass --gpus 1 or more, or leave it out.")
    if gpus_flag > n:
        raise ConfigError(f"--gpus {gpus_flag}: the node has {node_gpus} GPU(s)",
                          f"Pass --gpus {n} or less (leave it out for all of a node's GPUs).")
    if nodes > 1 and gpus_flag != n:
        raise ConfigError(f"--gpus {gpus_flag} on {nodes} nodes: a run on several nodes takes whole nodes",
                          "Leave --gpus out on a multi-node cluster.")
    return gpus_flag


def config(host: Host, want: int, node_gpus: int, node_usd_per_hour: float, now: bool) -> QueueConfig:
    """run.json's `queue` part for this node."""
    return QueueConfig(dir=queue_dir(host), want=want, slots=slots(node_gpus), gpus=node_gpus, now=now,
                       node_usd_per_hour=node_usd_per_hour)


def look(host: Host, run_dir: str) -> dict[str, Any] | None:
    """The run's place in the queue as the instance wrote it (RUN_DIR/queue.json), checked: state,
    position, share and times within bounds; None when absent or not believable."""
    raw = host.read_bytes(posixpath.join(run_dir, QUEUE_FILE), 0, 65537)
    if not raw or len(raw) > 65536:
        return None
    try:
        data = untrusted.loads(raw, 65536)
    except untrusted.Untrusted:  # a 64 KB `[[[[...` too: nested past the recursion limit
        return None
    if not isinstance(data, dict) or data.get("state") not in ("queued", "running", "dequeued", "cancelled"):
        return None
    out: dict[str, Any] = {"state": data["state"]}
    pos = data.get("position")
    if isinstance(pos, int) and not isinstance(pos, bool) and 1 <= pos <= 10000:
        out["position"] = pos
    share = data.get("share")
    if isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 <= share <= 1.0:
        out["share"] = float(share)
    for key in ("queued_at", "started_at"):
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e11:
            out[key] = float(v)
    if "queued_at" in out and "started_at" in out:
        waited = out["started_at"] - out["queued_at"]
        out["waited_s"] = waited if 0 <= waited <= 90 * 86400 else 0.0
    return out


def follow(run: RunRecord, place: dict[str, Any] | None, now: float) -> RunRecord:
    """The run as its place in the queue says: its position while queued; once it started, its
    start moved past the wait (its time, and dollars, count from there), once per job (a resume's
    or recovery's segment waits anew). What this machine saw bounds it: the start is never moved
    before the job was asked for nor past `now`, and a rewritten queue.json moves nothing again.
    Its $/h stays what it asked for (GPUs asked / the node's, ops/runs.py); the instance's share
    counts only for a `--now` run that holds no GPU (it runs beside the others: $0)."""
    if place is None:
        return run
    update: dict[str, Any] = {}
    if place["state"] == "queued" and run.queue_position != place.get("position"):
        update["queue_position"] = place.get("position")
    started = place.get("started_at")
    seg = run.segments[-1] if run.segments else None
    fresh = seg.queued_s is None if seg is not None else run.queue_started is None
    if started is not None and fresh:
        key = "resumed_at" if run.resumed_at is not None else "started_at"
        asked = getattr(run, key)
        waited = min(max(0.0, place.get("waited_s", 0.0)), max(0.0, now - asked))
        update.update(queue_started=started, queue_position=None)
        update[key] = asked + waited
        rate = 0.0 if run.now and run.nodes == 1 and place.get("share") == 0.0 else run.usd_per_hour
        update["usd_per_hour"] = rate
        if seg is not None:
            update["segments"] = run.segments[:-1] + (seg.model_copy(update={
                "started_at": min(seg.started_at + waited, max(seg.started_at, now)), "usd_per_hour": rate,
                "queued_s": waited}),)
    return run.model_copy(update=update) if update else run


def _payload(host: Host, *args: str) -> str:
    res = host.run([host.python, posixpath.join(guards.payload_dir(host), PAYLOAD), *args], check=False)
    return res.stdout.strip()


def dequeue(host: Host, run_id: str) -> bool:
    """Remove a run that waits in the host's queue (`gpuctl stop` of a queued run): True when it
    waited; its job then ends at once as stopped (exit 143), never having started. False when it
    was not queued there (running already, or over)."""
    return _payload(host, "dequeue", queue_dir(host), run_id) == "yes"


def close(host: Host) -> None:
    """The cluster goes down: runs queued until now never start (while `down` stops the others).
    A host that does not answer is not asked: `down` goes on (it ends the spend whatever the host says)."""
    try:
        _payload(host, "close", queue_dir(host))
    except GpuctlError:
        pass

