"""Finding everything gpuctl made in EC2 (by its tags) and releasing it, region by region."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

from gpuctl.errors import CloudError, GpuctlError
from gpuctl.model.records import Resource
from gpuctl.provision.aws import access, nodes, store_iam
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate
from gpuctl.remote.ssh.known_hosts import forget_host_keys
from gpuctl.retry import TimedOut, poll

Progress = Callable[[str], None]


def _tag(item: dict[str, Any], key: str) -> str | None:
    return next((t["Value"] for t in item.get("Tags", []) if t["Key"] == key), None)


def regions(aws: Aws) -> list[str]:
    """Enabled regions of the caller's partition. DescribeRegions lists only those; a region it
    marks "not-opted-in" anyway (moto lists all 38) is skipped: nothing can run there, and each
    region costs a client and four calls."""
    partition = set(aws.session.get_available_regions("ec2"))
    names = [r["RegionName"] for r in call(aws.ec2().describe_regions)["Regions"]
             if r.get("OptInStatus") != "not-opted-in"]
    return sorted(n for n in names if not partition or n in partition)


def discover(ctx: AwsContext, cluster: str | None = None, region: str | None = None) -> list[Resource]:
    """Every live instance, security group, key pair, placement group and instance profile tagged
    for this owner and cluster; with no cluster, every owner's in the account (see _resource).
    Never the checkpoint bucket: it outlives every cluster (`gpuctl runs rm` empties it run by run)."""
    aws = ctx.aws(region)
    names = [aws.region] if (region or cluster) else regions(aws)
    clients = {r: aws.ec2(r) for r in names}  # made here: creating clients is not thread-safe
    with ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(lambda r: _discover_region(ctx, clients[r], r, cluster), names))
    # IAM is global: the instance profiles are listed once and carry their region in a tag.
    for prof in store_iam.discover(aws, ctx.owner if cluster else None, cluster, aws.region if (region or cluster) else None):
        found.append([_resource(ctx, "instance-profile", prof["name"], prof["tags"].get(store_iam.TAG_REGION) or aws.region,
                                {"Tags": [{"Key": k, "Value": v} for k, v in prof["tags"].items()]})])
    return [res for batch in found for res in batch]


def _discover_region(ctx: AwsContext, ec2: Any, region: str, cluster: str | None) -> list[Resource]:
    # A lost or new gpuctl home gets a new owner id: what the old one made must still show in
    # `status --all`, so the search for everything asks for every owner's.
    filters = access.owner_filters(ctx.owner if cluster else None, cluster)
    out = [_resource(ctx, "instance", i["InstanceId"], region, i, i["State"]["Name"])
           for i in ctx.live_instances(ec2, cluster, every_owner=not cluster)]
    for g in call(ec2.describe_security_groups, Filters=filters).get("SecurityGroups", []):
        out.append(_resource(ctx, "security-group", g["GroupId"], region, g))
    for k in call(ec2.describe_key_pairs, Filters=filters).get("KeyPairs", []):
        out.append(_resource(ctx, "key-pair", k["KeyName"], region, k))
    for g in nodes.placement_groups(ec2, filters):
        out.append(_resource(ctx, "placement-group", g["GroupName"], region, g))
    return out


def _resource(ctx: AwsContext, kind: str, rid: str, region: str, item: dict[str, Any],
              state: str | None = None) -> Resource:
    cluster, owner = _tag(item, access.TAG_CLUSTER), _tag(item, access.TAG_OWNER)
    if owner == ctx.owner:
        return Resource(provider="aws", kind=kind, id=rid, region=region, cluster=cluster, state=state)
    # Another gpuctl install's (a lost home, a colleague's): it is no cluster of this one, so
    # `down --all` leaves it and only `down --all --any-owner` releases it. The state says whose.
    whose = f"another owner's: {owner or '?'}, cluster {cluster or '?'}"
    return Resource(provider="aws", kind=kind, id=rid, region=region, cluster=None,
                    state=f"{state}; {whose}" if state else whose)


def release(ctx: AwsContext, resources: list[Resource], progress: Progress) -> None:
    """Terminate instances, wait for them, then delete their groups and key pairs. Idempotent.
    The brake: a region or resource that fails (an error of any shape from AWS) is said and the
    rest go on; then one CloudError names every failure."""
    by_region: dict[str, list[Resource]] = {}
    for r in resources:
        by_region.setdefault(r.region or "", []).append(r)
    failed: list[str] = []
    for region, items in by_region.items():
        try:
            failed += _release_region(ctx, region, items, progress)
        except GpuctlError as exc:
            progress(f"{region}: {exc.message}")
            failed.append(f"{region}: {exc.message}")
    if failed:
        raise CloudError("not everything was released: " + "; ".join(failed[:4])
                         + (f" and {len(failed) - 4} more" if len(failed) > 4 else ""),
                         "Rerun `gpuctl down` (or `gpuctl down --all -y`) to finish; `gpuctl status --all` shows what "
                         "is left.")


def delete_when_free(delete: Callable[..., Any], op: str, busy: str, gone: str, **kwargs: Any) -> bool | None:
    """True once the resource is gone (deleted now, or already: AWS says `gone`); None while
    something still holds it (AWS says `busy`), to be asked again."""

    try:
        delete(**kwargs)
    except aws_errors() as exc:
        if error_code(exc) == busy:
            return None
        if error_code(exc) != gone:
            raise translate(exc, op) from exc
    return True


def _poll(attempt: Callable[[], bool | None], timeout_s: float, what: str, progress: Progress, hint: str) -> None:
    try:
        poll(attempt, timeout_s, on_wait=lambda waited, _: progress(f"waiting for {what} ({waited:.0f}s)"))
    except TimedOut:
        raise CloudError(f"timed out after {timeout_s:.0f}s waiting for {what}", hint) from None


def _release_region(ctx: AwsContext, region: str, items: list[Resource], progress: Progress) -> list[str]:
    """Release one region's resources; what failed ("what: why"), each said as it fails."""
    aws = ctx.aws(region)
    ec2 = aws.ec2()
    timeout = ctx.spec.wait_timeout_s
    failed: list[str] = []

    def attempt(what: str, step: Callable[[], None]) -> bool:
        try:
            step()
        except GpuctlError as exc:
            progress(f"{what}: not released: {exc.message}")
            failed.append(f"{what} ({exc.message})")
            return False
        return True

    instances = [r.id for r in items if r.kind == "instance"]
    if instances and not attempt(", ".join(instances), lambda: _terminate(ctx, ec2, region, instances, timeout, progress)):
        # What they use (their groups, keys, roles) stays in use: left for the next `down`.
        return failed
    for r in items:
        if r.kind == "security-group":
            # A group stays "in use" for a while after its instances terminate; no waiter covers it.
            if attempt(f"security group {r.id}", partial(_poll, partial(
                    delete_when_free, ec2.delete_security_group, "DeleteSecurityGroup", "DependencyViolation",
                    "InvalidGroup.NotFound", GroupId=r.id),
                    timeout, f"security group {r.id} to be free", progress, "Rerun `gpuctl down` in a minute to finish.")):
                progress(f"deleted security group {r.id}")
        elif r.kind == "placement-group":
            # Like a group, it is "in use" until its instances have terminated.
            if attempt(f"placement group {r.id}", partial(_poll, partial(
                    delete_when_free, ec2.delete_placement_group, "DeletePlacementGroup",
                    "InvalidPlacementGroup.InUse", "InvalidPlacementGroup.Unknown", GroupName=r.id),
                    timeout, f"placement group {r.id} to be free", progress, "Rerun `gpuctl down` in a minute to finish.")):
                progress(f"deleted placement group {r.id}")
        elif r.kind == "key-pair":
            if attempt(f"key pair {r.id}", partial(call, ec2.delete_key_pair, KeyName=r.id)):
                progress(f"deleted key pair {r.id}")
                if r.cluster:  # ours: its private half is here (another owner's has no cluster here)
                    path = access.key_path(ctx.home, r.cluster, region)
                    path.unlink(missing_ok=True)
                    path.with_suffix(".pub").unlink(missing_ok=True)
    for r in items:  # after the instances: a running one may still use its profile's credentials
        if r.kind == "instance-profile":
            if attempt(f"instance profile {r.id}", partial(store_iam.delete_profile, aws, r.id)):
                progress(f"deleted instance profile and role {r.id} (the checkpoint bucket stays)")
    return failed


def _terminate(ctx: AwsContext, ec2: Any, region: str, instances: list[str], timeout: float, progress: Progress) -> None:
    progress(f"terminating {', '.join(instances)} in {region}")
    call(ec2.terminate_instances, InstanceIds=instances)

    def gone() -> bool | None:
        # Polled rather than boto3's instance_terminated waiter, which gives up on an instance
        # that is stopping or pending: those still end terminated, and down must go on then.
        res = call(ec2.describe_instances, InstanceIds=instances)
        states = [i["State"]["Name"] for r in res["Reservations"] for i in r["Instances"]]
        return True if all(st == "terminated" for st in states) else None

    _poll(gone, timeout, f"{len(instances)} instance(s) to terminate", progress,
          "They are shutting down; rerun `gpuctl down` to finish removing their groups and keys.")
    # Their host keys go with them: the next instance on a recycled address is a new machine.
    forget_host_keys(ctx.home, {access.key_alias(i) for i in instances})
