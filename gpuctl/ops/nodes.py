"""Runs across the nodes of a cluster: TensorFlow's MultiWorkerMirroredStrategy does the
distributing; gpuctl puts the same job on every node with what the strategy reads (TF_CONFIG: every
node's address and a port free there, this node's index) and follows them as one run.

Node 0 is the chief: its epoch reports (global batches, so its examples count every node's) and
its checkpoint are the run's. A node that fails ends the run on all of them: TensorFlow's own
health check fails the others' collectives within seconds; what is left is stopped by the command
that follows the run (run_state.settle) or, with nobody following, by each node's stall guard, so
no node waits, billed, for a peer that is gone.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpuctl.errors import ConfigError, RemoteError, RunFailedError, Unconfirmed
from gpuctl.model.data import FetchStats
from gpuctl.model.records import ENDED_STATES, ClusterRecord, InstanceRecord, RunRecord, SyncStats
from gpuctl.model.results import TfEnv
from gpuctl.ops.session import Progress, Session, each
from gpuctl.ops.verdicts import RUNNING, NodeState
from gpuctl.payloads.gpuctl_protocol import NOTICE_FILE, PREEMPTED_EXIT, PREEMPTED_MARK, STOPPED_EXIT
from gpuctl.remote import guard, jobs
from gpuctl.remote.host import Host


@dataclass(frozen=True)
class Node:
    rank: int
    inst: InstanceRecord
    host: Host
    env: TfEnv | None = None  # its TensorFlow (the setup step's answer)
    code_dir: str = ""
    data_dir: str | None = None
    code: SyncStats | None = None
    data: SyncStats | None = None
    fetched: FetchStats | None = None  # an S3 data set it fetched itself (ops/datasets.py)
    layered: str | None = None  # the Python of the project's packages' venv, over env's (ops/packages.py)

    @property
    def python(self) -> str:
        if self.layered:
            return self.layered
        env = self.env
        return ((env.report or {}).get("executable") or env.python) if env is not None else "python3"

    def paths(self, run: RunRecord) -> jobs.JobPaths:
        """The run's files on this node: the chief's are the run's own; another node keeps its
        files in its own work dir (local nodes share one machine)."""
        if self.rank == 0:
            return jobs.JobPaths(run.run_dir)
        return jobs.JobPaths(posixpath.join(self.host.root, "runs", run.run_id))

    @property
    def address(self) -> str:
        """Where the other nodes reach it: its private address, else the one gpuctl logs in to."""
        return self.inst.private_ip or self.inst.public_ip or "127.0.0.1"


def of(s: Session, record: ClusterRecord) -> list[Node]:
    """The cluster's nodes, chief first; a node whose machine ended is missing, not renumbered."""
    pairs = s.hosts(record)
    ranks = [inst.node for inst, _ in pairs]
    if len(set(ranks)) != len(ranks):  # hosts recorded before nodes had ranks (ssh): in their order
        ranks = list(range(len(pairs)))
    return [Node(rank=r, inst=inst, host=host) for r, (inst, host) in zip(ranks, pairs)]


def of_run(s: Session, record: ClusterRecord, run: RunRecord) -> list[Node]:
    """The nodes a run runs on (the cluster's first `run.nodes`)."""
    return of(s, record)[:max(run.nodes, 1)]


def rate(group: list[Node]) -> float:
    """$/h of these nodes together: what a run on them costs."""
    return sum(n.inst.usd_per_hour for n in group)


def label(node: Node, nodes: list[Node]) -> str:
    return f"node {node.rank}: " if len(nodes) > 1 else ""


def keras_for(setting: str, nodes: int) -> str:
    """The Keras a run uses: Keras 3's fit fails under MultiWorkerMirroredStrategy on current
    TensorFlow (keras#20585, tensorflow#72388), tf_keras (Keras 2) works: auto picks it for nodes."""
    return setting if setting != "auto" else ("2" if nodes > 1 else "3")


# Runs on the node with its job's Python: tf_keras's version without importing TensorFlow.
# An empty tf_keras directory is a namespace package: a spec without an origin, no Keras.
KERAS_PROBE = ("import importlib.util, importlib.metadata as m\n"
               "spec = importlib.util.find_spec('tf_keras')\n"
               "try:\n    v = m.version('tf-keras')\nexcept Exception:\n    v = None\n"
               "print((v or '?') if spec is not None and spec.origin else '')")


def require_keras2(nodes: list[Node], tensorflow: str | None) -> None:
    """Refuse a Keras 2 run on a node whose Python lacks tf_keras (its script would fall back to
    Keras 3 and fail under the strategy, on every node, after the push)."""
    def probe(node: Node) -> str:
        return node.host.run([node.python, "-c", KERAS_PROBE], check=False).stdout.strip()

    for node, version in zip(nodes, each(nodes, probe)):
        if not version:
            pin = ".".join((tensorflow or "2.21").split(".")[:2])
            raise RemoteError(
                f"node {node.rank} ({node.host.label}): tf_keras is not installed for {node.python}",
                f"Multi-node runs use Keras 2: `{node.python} -m pip install 'tf-keras=={pin}.*'` there (gpuctl's "
                "setup step installs it), or set `[train] keras = \"3\"` if your script needs no Keras fit.")


# Runs on the node: a port nothing listens on now (the OS's pick), for the job's TensorFlow server.
PORT_PROBE = "import socket\ns = socket.socket()\ns.bind(('', 0))\nprint(s.getsockname()[1])"


def free_port(node: Node, taken: set[tuple[str, int]]) -> int:
    """A port free on the node and not given to another node at the same address (local nodes
    share one machine)."""
    for _ in range(8):
        out = node.host.run([node.python, "-c", PORT_PROBE]).stdout.strip()
        if not out.isdigit() or not 1024 <= int(out) <= 65535:  # the node's answer is not trusted
            raise RemoteError(f"node {node.rank} ({node.host.label}) gave no usable port: {out[:40]!r}",
                              "Check that its Python runs: `gpuctl exec -- python3 -V`.")
        if (node.address, int(out)) not in taken:
            taken.add((node.address, int(out)))
            return int(out)
    raise RemoteError(f"no free port found on node {node.rank} ({node.host.label})", "Try again.")


def job_env(nodes: list[Node], keras: str) -> list[dict[str, str]]:
    """Each node's variables for its job, node 0 first."""
    taken: set[tuple[str, int]] = set()
    workers = [f"{n.address}:{free_port(n, taken)}" for n in nodes] if len(nodes) > 1 else []
    out = []
    for node in nodes:
        env = {"GPUCTL_NODE_RANK": str(node.rank), "GPUCTL_NUM_NODES": str(len(nodes))}
        if workers:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                           "task": {"type": "worker", "index": node.rank}})
        if keras == "2":
            env["TF_USE_LEGACY_KERAS"] = "1"
        out.append(env)
    return out


def share_checkpoint(group: list[Node], run: RunRecord, progress: Progress) -> None:
    """Copy the chief's checkpoint directory to the other nodes (through this machine: nodes need
    not reach each other over SSH)."""
    if len(group) < 2:
        return
    with tempfile.TemporaryDirectory(prefix="gpuctl-ckpt-") as tmp:
        files, _ = group[0].host.pull_tree(checkpoint_dir(group[0].paths(run)), Path(tmp))
        each(group[1:], lambda n: n.host.push(Path(tmp), checkpoint_dir(n.paths(run))))
    progress(f"the chief's checkpoint ({files} files) copied to nodes 1-{len(group) - 1}")


def checkpoint_dir(paths: jobs.JobPaths) -> str:
    """Where Keras fits of the run checkpoint (run.json's checkpoint_dir)."""
    return posixpath.join(paths.outputs, "checkpoint")


# --- following a multi-node run ------------------------------------------------------------------

def notice_file(host: Host) -> str:
    """Where the node's watchdog records a spot interruption notice (the launcher reads it)."""
    return posixpath.join(guard.guard_dir(host), NOTICE_FILE)


def _look(node: Node, run: RunRecord) -> NodeState:
    paths = node.paths(run)
    state, code = jobs.job_state(node.host, run.run_id, paths, record=False)  # a look writes nothing there
    if state == "running" and _unconfirmed(run, node.rank):
        mark = node.host.read_bytes(paths.node_started, 0, 64)  # bytes of the instance's: compared, never shown
        state = "running" if (mark or b"").strip() == str(node.rank).encode() else "starting"
    elif state == "failed" and code == STOPPED_EXIT:  # stopped by `down` or a guard, after its graceful exit
        state = "stopped"
    elif state == "failed" and code == PREEMPTED_EXIT and node.host.read_bytes(
            posixpath.join(paths.run_dir, PREEMPTED_MARK), 0, 1) is not None:
        state = "preempted"  # the launcher's word that a notice stopped it, not just a script's exit 75
    return NodeState(node.rank, state, code, jobs.ended_at(node.host, paths) if state not in RUNNING else None)


def _unconfirmed(run: RunRecord, rank: int) -> bool:
    """Whether the node's start is still to be seen (a run with a start deadline, on several nodes,
    whose node was not seen running as itself yet)."""
    return bool(run.start_timeout_s) and run.nodes > 1 and not (
        rank < len(run.node_states) and run.node_states[rank] == "running")


def states(nodes: list[Node], run: RunRecord) -> list[NodeState]:
    return each(nodes, lambda n: _look(n, run))


def notices(group: list[Node]) -> set[int]:
    """The ranks whose machine heard a spot interruption notice (its watchdog's file)."""
    heard = each(group, lambda n: bool(n.host.read_bytes(notice_file(n.host), 0, 1)))
    return {n.rank for n, h in zip(group, heard) if h}


def did_not_start(run: RunRecord) -> RunFailedError | None:
    """The error for a run that ended because nodes did not start (None for any other end)."""
    if not run.not_started:
        return None
    ranks = ", ".join(map(str, run.not_started))
    return RunFailedError(
        f"run {run.run_id} failed: node(s) {ranks} did not start within {run.start_timeout_s:g} s "
        "(stopped on every node)",
        "Nodes that share a work dir (one NFS home) start each other's jobs: `gpuctl down`, then `gpuctl up` gives "
        f"each its own (or set remote.workdir to a local disk); `gpuctl logs {run.run_id} --node "
        f"{run.not_started[0]}` shows what it printed.")


def stop(group: list[Node], run: RunRecord, grace_s: float = jobs.STOP_GRACE_S, must: bool = True) -> list[int | None]:
    """Stop the run's job on these nodes (nothing where it does not run); their exit codes. A
    node whose tmux does not answer raises Unconfirmed, or with `must` False counts as None."""
    return [None if isinstance(c, Unconfirmed) else c for c in each(group, lambda n: _stop_one(n, run, grace_s, must))]


def _stop_one(node: Node, run: RunRecord, grace_s: float, must: bool) -> int | None | Unconfirmed:
    try:
        return jobs.stop_job(node.host, run.run_id, node.paths(run), grace_s)
    except Unconfirmed as exc:
        if must:
            raise
        return exc


def run_instances(s: Session, cluster_id: int, run: RunRecord) -> list[InstanceRecord]:
    """The ledger's records of the machines the run is on now (every node's); every machine of
    its cluster while it has no segment."""
    ids = run.segments[-1].instance_ids if run.segments else None
    return [i for i in s.ledger.instances(cluster_id) if ids is None or i.id in ids]


def gone(s: Session, record: ClusterRecord, run: RunRecord) -> InstanceRecord | None:
    """A machine of the run's nodes that ended under it, as the ledger knows (an interruption, a
    guard): one node of several gone ends the run, however the others look."""
    if run.nodes < 2 or not run.segments:
        return None
    return next((i for i in run_instances(s, record.id, run) if i.state in ENDED_STATES), None)


def stop_rest(group: list[Node], run: RunRecord, ranks: tuple[int, ...]) -> set[int]:
    """Stop the run's job on the nodes `ranks` (a Decision's `stop`: still running a run that has
    ended elsewhere); the ranks whose tmux did not answer, passed over (the run has ended all the
    same, and `down` ends what runs on there)."""
    running = [n for n in group if n.rank in ranks]
    ends = each(running, lambda n: _stop_one(n, run, jobs.STOP_GRACE_S, must=False))
    return {n.rank for n, end in zip(running, ends) if isinstance(end, Unconfirmed)}


def refuse_budget(group: list[Node], budget_usd: float) -> None:
    """No per-run budget on several nodes: every node would have to stop at the same batch, or
    the others wait for it forever."""
    if len(group) > 1 and budget_usd:
        raise ConfigError("a run budget (train --budget / train.budget_usd) is for one-node clusters",
                          "On several nodes cap the cluster's spend instead: `gpuctl guard set --budget DOLLARS`.")
