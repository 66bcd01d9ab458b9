"""What a run's state is, and what should be done about it, from what a look saw: pure functions
(no clock, no host, no ledger), as payloads/gpuctl_decide.py is for the watchdog.

A look (`status`, `cost`, `logs`...) observes the nodes, calls `decide` and records the Decision's
state in the ledger; only a command that acts (`train --wait`, `logs -f`, `watch`, `stop`, `down`)
does what it says (run_state.settle: the nodes still running a run that ended are stopped). What
must not wait for anyone to look (a node left waiting, billed, on a peer that is gone) is the
instance's watchdog's: gpuctl_decide's stall guard fires for a job of several nodes.
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass, replace

from gpuctl.model.records import FINAL_RUN_STATES, InstanceRecord, RunRecord


@dataclass(frozen=True)
class NodeState:
    rank: int
    state: str
    code: int | None
    ended_at: float | None


RUNNING = ("running", "starting")  # "starting": its job runs, but has not started as this node yet
NOT_STARTED = "not started"


@dataclass(frozen=True)
class Decision:
    """What a look at a run decided: its state, exit code and the node that ended it (None: none
    did, or one node); `nodes`: each node's state as seen; `stop`: the ranks still running a run
    that has ended (they would wait for their peers, billed: the act path stops them); `late`: the
    ranks whose job did not start within the run's start deadline."""

    state: str
    exit_code: int | None
    failed_node: int | None
    nodes: tuple[NodeState, ...]
    stop: tuple[int, ...] = ()
    late: tuple[int, ...] = ()

    def after_stop(self, unconfirmed: set[int]) -> tuple[str, ...]:
        """The nodes' states once `stop` was done (a rank tmux did not confirm stays as seen)."""
        def one(n: NodeState) -> str:
            if n.rank not in self.stop or n.rank in unconfirmed:
                return n.state
            return NOT_STARTED if n.rank in self.late else "stopped"
        return tuple(one(n) for n in self.nodes)


def late(run: RunRecord, seen: list[NodeState], now: float) -> list[int]:
    """The nodes whose job has not started as theirs `start_timeout_s` after the run started
    (past the queue): the others wait for them, billed, until TensorFlow gives up, if ever."""
    if not run.start_timeout_s or now - (run.resumed_at or run.started_at) < run.start_timeout_s:
        return []
    return [n.rank for n in seen if n.state == "starting"]


def with_gone(seen: list[NodeState], gone: InstanceRecord | None) -> list[NodeState]:
    """The nodes' states with the one whose machine ended (`gone`, which cannot be asked) counted
    as lost then; as succeeded when every other node succeeded (its machine was powered off
    after its job, as `down_after_run` does)."""
    if gone is None:
        return seen
    state = "succeeded" if all(n.state == "succeeded" for n in seen) else "lost"
    return sorted([*seen, NodeState(gone.node, state, None, gone.terminated_at)], key=lambda n: n.rank)


def with_notices(seen: list[NodeState], heard: set[int]) -> list[NodeState]:
    """A node whose machine heard a spot notice (`heard`: their ranks) is preempted however its job
    ended (its peers' failure may have ended it first), and `leaving` while its job still runs (it
    stops at a batch end and saves): its machine is going, and a preempted run is resumed where a
    failed one is not."""
    return [replace(n, state="leaving" if n.state in RUNNING else "preempted") if n.rank in heard else n
            for n in seen]


def verdict(seen: list[NodeState]) -> tuple[str, int | None, int | None]:
    """(the run's state, its exit code, the node that ended it) from its nodes' states: succeeded
    when all did; else, once any ended otherwise, the one that ended first decides (the others
    failed because it did). A node stopped by a spot notice decides whenever there is one: its
    peers fail when it leaves, sometimes before it has finished leaving, and a preempted run is
    resumed where a failed one is not."""
    if all(n.state == "succeeded" for n in seen):
        return "succeeded", 0, None
    bad = [n for n in seen if n.state not in (*RUNNING, "leaving", "succeeded")]
    preempted = [n for n in bad if n.state == "preempted"]
    if not bad or (not preempted and any(n.state == "leaving" for n in seen)):
        return "running", None, None  # a node leaving on a notice is waited for: it decides
    first = min(preempted or bad, key=lambda n: (n.ended_at is None, n.ended_at or 0.0, n.rank))
    return first.state, first.code, first.rank


def needs_notices(run: RunRecord, seen: list[NodeState]) -> bool:
    """Whether the nodes' spot notices must be read before deciding: a run of several nodes that
    would otherwise end (a node that heard one is leaving, and decides)."""
    return run.nodes > 1 and run.state not in FINAL_RUN_STATES and verdict(seen)[0] not in ("running", "succeeded")


def decide(run: RunRecord, seen: list[NodeState], place: dict[str, Any] | None, now: float, chief: bool = True) -> Decision:
    """The run's state from its nodes (`seen`, the gone and notices counted in), its place in the
    cluster's queue (`place`: queue.look's answer on the chief, None when it has none; `chief`
    False: the chief's machine is gone, nothing of it was asked) and the time; and which nodes
    should be stopped. A run already ended keeps its verdict: what still runs of it is only to stop."""
    running = tuple(n.rank for n in seen if n.state in RUNNING)
    if run.state in FINAL_RUN_STATES:
        return Decision(run.state, run.exit_code, run.failed_node, tuple(seen), stop=running)
    state, code, failed = verdict(seen)
    if state != "running":  # ended on one node: the others would wait for it, billed
        return Decision(state, code, failed, tuple(seen), stop=running)
    if run.gpus and chief and (place is None or place["state"] == "queued"):
        return Decision("queued", None, None, tuple(seen))
    overdue = tuple(late(run, seen, now))
    if overdue:  # past the queue, not started on some nodes: the others would wait for them, billed
        return Decision("failed", None, overdue[0], tuple(seen), stop=running, late=overdue)
    return Decision("running", None, None, tuple(seen))
