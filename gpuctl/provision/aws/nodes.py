"""A cluster's nodes: all in one zone or none, ranked by their `gpuctl:node` tag, optionally in
a cluster placement group.

Zones are tried in the order given (cheapest spot price first), each node with its own request.
A capacity, quota or price-too-low answer for any node ends the nodes launched in that zone
before the next zone is tried: MultiWorkerMirroredStrategy's all-reduce crosses zones slowly and
at a price per GB, and a partial cluster trains nothing. Spot may fall back to on-demand. When
every attempt fails, one error names each zone and its reason, nothing of the attempts runs, and
the hint names the quota to raise.
"""

from __future__ import annotations

from typing import Any, Callable

from gpuctl.errors import CloudError, NoCapacityError
from gpuctl.provision.aws import access
from gpuctl.provision.aws.launch import LaunchPlan, run_instances, run_params
from gpuctl.provision.aws.session import (
    CAPACITY_CODES,
    QUOTA_CODES,
    Aws,
    aws_errors,
    call,
    error_code,
    error_message,
    quota_hint,
    translate,
    wait_for,
)

Progress = Callable[[str], None]
ENDED = ("shutting-down", "terminated")
# Client tokens a node may find used up by earlier rolled-back attempts in the same zone.
TOKEN_GENERATIONS = 8


def rank(inst: dict[str, Any]) -> int:
    """An instance's node rank from its tag; one made before multi-node clusters has none: 0."""
    value = next((t["Value"] for t in inst.get("Tags", []) if t["Key"] == access.TAG_NODE), "0")
    try:
        return int(value)
    except ValueError:
        return -1  # not a rank gpuctl wrote: reusable() refuses the cluster


def reusable(existing: list[dict[str, Any]], nodes: int, cluster: str) -> list[dict[str, Any]]:
    """The live instances found by tag for a cluster of `nodes` nodes, by rank, if they are that
    cluster; a leak or a vanished node is an error, never a silently bigger or smaller cluster."""
    ids = ", ".join(i["InstanceId"] for i in existing)
    if len(existing) > nodes:
        raise CloudError(
            f"found {len(existing)} instances tagged for cluster {cluster!r} where {nodes} was asked: {ids} (a leak)",
            f"`gpuctl down {cluster} -y` releases them all; then `gpuctl up` again.",
        )
    ranked = sorted(existing, key=rank)
    if [rank(i) for i in ranked] != list(range(nodes)):
        have = ", ".join(f"{i['InstanceId']} (node {rank(i)})" for i in ranked)
        raise CloudError(
            f"cluster {cluster!r} has {len(existing)} of its {nodes} nodes left: {have}",
            f"A node has ended; gpuctl does not run a partial cluster. `gpuctl down {cluster} -y`, then `gpuctl up` again.",
        )
    return ranked


def _nothing(*_: Any) -> None:
    pass


def launch_nodes(aws: Aws, plan: LaunchPlan, progress: Progress,
                 launched: Callable[[dict[str, Any], int, str], None] = _nothing,
                 ended: Callable[[list[str]], None] = _nothing) -> tuple[list[dict[str, Any]], str]:
    """Launch plan.nodes instances in the first zone (and market) with room for all of them;
    return their descriptions by rank and the market used. `launched(instance, node, market)`
    hears each one as soon as EC2 answers with it, before the next node is asked for; `ended(ids)`
    hears the nodes of a zone given up, once they have ended."""

    markets = [plan.market] + (["on-demand"] if plan.market == "spot" and plan.fallback_on_demand else [])
    failures: list[str] = []
    quota = False
    for market in markets:
        for zone in plan.subnets:
            made: list[dict[str, Any]] = []
            try:
                for node in range(plan.nodes):
                    which = f", node {node} of {plan.nodes}" if plan.nodes > 1 else ""
                    progress(f"requesting {plan.instance_type} ({market}) in {zone}{which}")
                    made.append(_launch_node(aws, plan, zone, market, node, progress))
                    launched(made[-1], node, market)
                return made, market
            except aws_errors() as exc:
                code = error_code(exc)
                _roll_back(aws, plan, zone, made, f"node {len(made)}: {code}", progress, ended)
                if code not in CAPACITY_CODES:
                    raise translate(exc, "RunInstances") from exc
                quota = quota or code in QUOTA_CODES
                where = f" (node {len(made)})" if plan.nodes > 1 else ""
                failures.append(f"{zone} {market}: {code}{where}")
                progress(f"{zone} {market}: {code}: {error_message(exc)[:120]}")
            except Exception as exc:
                _roll_back(aws, plan, zone, made, type(exc).__name__, progress, ended)
                raise
    hint = "Try again later, another region (--region), or on-demand (--on-demand / --fallback-on-demand)."
    if quota:
        hint = quota_hint(plan.instance_type, plan.market) + " " + hint
    if plan.nodes > 1:
        hint = f"No zone had room for all {plan.nodes} nodes at once; fewer nodes (--nodes) may fit. " + hint
    what = f"{plan.nodes} x {plan.instance_type} in one zone" if plan.nodes > 1 else plan.instance_type
    raise NoCapacityError(f"no capacity for {what}: " + "; ".join(failures), hint)


def _launch_node(aws: Aws, plan: LaunchPlan, zone: str, market: str, node: int, progress: Progress) -> dict[str, Any]:

    for generation in range(TOKEN_GENERATIONS):
        try:
            inst = run_instances(aws, run_params(plan, zone, market, node, generation), progress)["Instances"][0]
        except aws_errors() as exc:
            if error_code(exc) != "IdempotentInstanceTerminated":
                raise
            inst = {"State": {"Name": "terminated"}}
        # EC2 answers a used token with the instance it made then: an ended one is an earlier
        # attempt's, rolled back; this attempt needs a token of its own.
        if inst.get("State", {}).get("Name") not in ENDED:
            return inst
        progress(f"node {node} in {zone}: that request's client token belongs to an ended instance; asking anew")
    raise CloudError(f"node {node} in {zone}: {TOKEN_GENERATIONS} client tokens in a row belong to ended instances",
                     "Run `gpuctl down -y` and `gpuctl up` again: a new cluster gets new tokens.")


def _roll_back(aws: Aws, plan: LaunchPlan, zone: str, launched: list[dict[str, Any]], why: str,
               progress: Progress, ended: Callable[[list[str]], None]) -> None:
    """End the nodes launched in a zone that could not take them all, and wait until they have
    ended, so that whatever comes next never finds a partial cluster running."""
    if not launched:
        return
    ids = [i["InstanceId"] for i in launched]
    progress(f"{zone}: {why}: terminating node(s) 0..{len(ids) - 1} launched there ({', '.join(ids)}); "
             "all nodes share one zone or none runs")
    ec2 = aws.ec2()
    call(ec2.terminate_instances, InstanceIds=ids)
    wait_for(ec2, "instance_terminated", plan.wait_timeout_s, what=f"{', '.join(ids)} to terminate",
             hint="`gpuctl status --all` lists them; `gpuctl down -y` releases them.", InstanceIds=ids)
    ended(ids)
    progress(f"{zone}: terminated {', '.join(ids)}")


# --- the cluster placement group -----------------------------------------------------------------


def ensure_placement_group(aws: Aws, cluster: str, owner: str) -> str:
    """The cluster's placement group (strategy cluster: its nodes on one low-latency network
    segment), tagged at creation; found again by name if an earlier `up` made it."""

    ec2 = aws.ec2()
    name = access.resource_name(cluster, owner)
    found = call(ec2.describe_placement_groups,
                 Filters=[{"Name": "group-name", "Values": [name]}, {"Name": "state", "Values": ["pending", "available"]}])
    if found.get("PlacementGroups"):
        return name
    try:
        ec2.create_placement_group(GroupName=name, Strategy="cluster",
                                   TagSpecifications=[access.tag_spec("placement-group", cluster, owner)])
    except aws_errors() as exc:
        if error_code(exc) != "InvalidPlacementGroup.Duplicate":  # a concurrent `up` made it
            raise translate(exc, "CreatePlacementGroup") from exc
    return name


def placement_groups(ec2: Any, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpuctl's placement groups matching the tag filters (not those being deleted)."""
    states = {"Name": "state", "Values": ["pending", "available"]}
    return call(ec2.describe_placement_groups, Filters=filters + [states]).get("PlacementGroups", [])
