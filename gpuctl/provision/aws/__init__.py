"""The `aws` provider: EC2 GPU instances from the newest TensorFlow Deep Learning AMI.

Instances, security groups and key pairs are found by their tags, never by local memory, so an
`up` killed at any moment leaves nothing that `gpuctl status --all` cannot see and
`gpuctl down --all -y` cannot remove.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from gpuctl.errors import CloudError, NoCapacityError, RemoteError
from gpuctl.provision.aws import access, catalog
from gpuctl.provision.aws.launch import LaunchPlan, launch_one
from gpuctl.provision.aws.session import Aws, call, error_code, translate
from gpuctl.provision.aws.userdata import HARD_CAP_MARK, hard_cap_script
from gpuctl.remote.ssh import Endpoint, SshHost
from gpuctl.settings import Settings
from gpuctl.types import ClusterSpec, InstanceRecord, Resource

Progress = Callable[[str], None]
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def _quiet(_: str) -> None:
    pass


def backoff_wait(check: Callable[[], Any], timeout_s: float, what: str, progress: Progress, hint: str) -> Any:
    """Poll `check` (truthy = done) with backoff 1, 2, 4 .. 10 s until `timeout_s`; the error names it."""
    deadline = time.monotonic() + timeout_s
    delay = 1.0
    start = time.monotonic()
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() + delay > deadline:
            raise CloudError(f"timed out after {timeout_s:.0f}s waiting for {what}", hint)
        progress(f"waiting for {what} ({time.monotonic() - start:.0f}s)")
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


def _transition_time(inst: dict[str, Any]) -> float | None:
    """EC2 says when an instance stopped in StateTransitionReason: 'User initiated (2026-11-30 04:00:00 GMT)'
    (moto writes UTC)."""
    import datetime as dt
    import re

    m = re.search(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)", inst.get("StateTransitionReason", ""))
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()


def running_periods(inst: InstanceRecord, state: str, live: dict[str, Any] | None,
                    ended: float | None) -> tuple[tuple[float, float | None], ...]:
    """The instance's running periods after a state change seen now (a stop and a start make two).

    A stop is closed at EC2's transition time. A start opens at EC2's LaunchTime (which EC2 moves
    on every start); where it did not move past the last stop (moto does not), at the time gpuctl
    saw it running, the best that is known.
    """
    periods = list(inst.periods) or [(inst.launched_at, None)]
    start, end = periods[-1]
    now = time.time()
    if state == "running" and end is not None:
        launch = live["LaunchTime"].timestamp() if live and hasattr(live.get("LaunchTime"), "timestamp") else 0.0
        periods.append((launch if launch > end else now, None))
    elif state != "running" and end is None:
        periods[-1] = (start, max(start, ended or now))
    return tuple(periods)


def _tag(item: dict[str, Any], key: str) -> str | None:
    return next((t["Value"] for t in item.get("Tags", []) if t["Key"] == key), None)


class AwsProvider:
    name = "aws"
    reuses_live_clusters = True  # `up` again on a live cluster finds it by tag and reuses it

    def __init__(self, home: Path, settings: Settings):
        self.home = Path(home)
        self.settings = settings
        self._owner: str | None = None

    @property
    def owner(self) -> str:
        if self._owner is None:
            self._owner = access.owner_id(self.home)
        return self._owner

    def _aws(self, region: str | None = None) -> Aws:
        return Aws(region=region or self.settings.aws.region, profile=self.settings.aws.profile)

    # --- launch ---------------------------------------------------------------------------------

    def launch(self, spec: ClusterSpec, progress: Progress = _quiet, wait_ssh: bool = True) -> list[InstanceRecord]:
        a = self.settings.aws
        aws = self._aws(spec.region)
        existing = self._live_instances(aws.ec2(), spec.name)
        if existing:
            if len(existing) > spec.nodes:
                ids = ", ".join(i["InstanceId"] for i in existing)
                raise CloudError(
                    f"found {len(existing)} instances tagged for cluster {spec.name!r} where {spec.nodes} was asked: {ids} (a leak)",
                    f"`gpuctl down {spec.name} -y` releases them all; then `gpuctl up` again.",
                )
            progress(f"reusing {existing[0]['InstanceId']} ({existing[0]['State']['Name']}), found by its tags")
            return [self._record(aws, existing[0], spec, None, "recorded at launch")]

        # Check everything that can be checked before creating anything.
        info = catalog.instance_type_info(aws, spec.instance_type)
        archs = info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
        arch = "x86_64" if "x86_64" in archs else archs[0]
        zones = catalog.zones_offering(aws, spec.instance_type)
        if not zones:
            raise NoCapacityError(
                f"{spec.instance_type} is not offered in any zone of {aws.region}", "Try another region (--region)."
            )
        market = spec.market
        spot = catalog.spot_prices(aws, spec.instance_type) if market == "spot" else {}
        if market == "spot" and not spot:
            if not a.fallback_on_demand:
                raise CloudError(
                    f"{spec.instance_type} has no spot offering in {aws.region}",
                    "Launch it on-demand (--on-demand), or let gpuctl fall back (--fallback-on-demand).",
                )
            progress(f"{spec.instance_type} has no spot offering in {aws.region}: falling back to on-demand")
            market = "on-demand"
        if market == "spot":
            zones = sorted(zones, key=lambda z: spot.get(z, float("inf")))
        image = catalog.image_by_id(aws, spec.image) if spec.image else catalog.newest_image(aws, a.image_pattern, arch)
        progress(f"image {image.get('Name', '?')} ({image['ImageId']}, {image.get('CreationDate', '?')[:10]})")
        cidr, open_world = access.ssh_cidr(a.ssh_cidr)
        if open_world:
            progress(f"WARNING: SSH is open to the whole internet ({cidr}) because you asked for it")
        vpc = access.default_vpc(aws)
        subnets = access.zone_subnets(aws, vpc)
        ordered = {z: subnets[z] for z in zones if z in subnets}
        if not ordered:
            raise CloudError(f"the default VPC has no subnet in the zones offering {spec.instance_type}: {', '.join(zones)}")

        # From here on, resources exist; each is tagged as it is created.
        key_name, key_path = access.ensure_key_pair(aws, self.home, spec.name, self.owner)
        progress(f"key pair {key_name} (private key {key_path}, 0600)")
        group = access.ensure_security_group(aws, vpc, spec.name, self.owner, cidr)
        progress(f"security group {group}: SSH from {cidr} only")
        plan = LaunchPlan(
            cluster=spec.name, owner=self.owner, instance_type=spec.instance_type, image_id=image["ImageId"],
            root_device=image.get("RootDeviceName", "/dev/sda1"), key_name=key_name, security_group=group,
            subnets=ordered, market=market, max_price=spec.max_price or 0.0,
            fallback_on_demand=a.fallback_on_demand, disk_gb=spec.disk_gb,
            user_data=hard_cap_script(self.settings.guards.max_hours),
            token_seed=f"{self.owner}|{spec.name}|{spec.launch_token}",
        )
        inst, used = launch_one(aws, plan, progress)
        iid = inst["InstanceId"]
        progress(f"launched {iid} ({used}) in {inst['Placement']['AvailabilityZone']}")
        inst = self.wait_running(aws, iid, progress)
        zone = inst["Placement"]["AvailabilityZone"]
        if used == "spot":
            usd, source = spot.get(zone) or catalog.spot_prices(aws, spec.instance_type).get(zone, 0.0), "spot price history"
        else:
            usd, source = catalog.on_demand_price(aws, spec.instance_type, self.home / "cache")
        record = self._record(aws, inst, spec, usd, source, image)
        reference = catalog.ON_DEMAND_USD.get(spec.instance_type)
        record = record.model_copy(update={
            "price_steps": ((record.launched_at, record.usd_per_hour),),
            "on_demand_usd_per_hour": usd if used == "on-demand" else reference,
        })
        if wait_ssh:
            # Log in once: proves SSH works with the cluster's key, and pins the host key.
            host = self.host(record, progress=progress)
            host.run(["mkdir", "-p", record.workdir], cwd=False)
            record = record.model_copy(update={"workdir": host.root})
            progress(f"SSH works: {host.label}, host key pinned")
            cap = host.read_bytes(HARD_CAP_MARK)
            if cap:
                at, _, how = cap.decode().strip().partition(" ")
                progress(f"hard cap armed ({how}): powers off at {time.strftime('%Y-%m-%d %H:%M', time.localtime(float(at)))}")
            else:
                progress(f"WARNING: the boot-time hard cap is not confirmed yet ({HARD_CAP_MARK} missing; cloud-init "
                         "may still be running); the watchdog enforces max_hours as well")
            host.close()
        return [record]

    def wait_running(self, aws: Aws, iid: str, progress: Progress) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            res = call(aws.ec2().describe_instances, InstanceIds=[iid])
            inst = res["Reservations"][0]["Instances"][0]
            state = inst["State"]["Name"]
            if state in ("terminated", "shutting-down"):
                reason = inst.get("StateReason", {}).get("Message", "no reason given")
                raise CloudError(f"{iid} ended while starting: {reason}", "Try again, or another zone/market.")
            return inst if state == "running" else None

        return backoff_wait(check, self.settings.aws.wait_timeout_s, f"{iid} to run", progress,
                            f"{iid} may still start: `gpuctl status --all`; `gpuctl down -y` releases it.")

    def _record(self, aws: Aws, inst: dict[str, Any], spec: ClusterSpec, usd: float | None, source: str,
                image: dict[str, Any] | None = None) -> InstanceRecord:
        return InstanceRecord(
            id=inst["InstanceId"],
            cluster=spec.name,
            state=inst["State"]["Name"],
            public_ip=inst.get("PublicIpAddress"),
            private_ip=inst.get("PrivateIpAddress"),
            zone=inst.get("Placement", {}).get("AvailabilityZone"),
            market="spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand",
            usd_per_hour=usd if usd is not None else 0.0,
            price_source=source,
            launched_at=inst["LaunchTime"].timestamp() if hasattr(inst.get("LaunchTime"), "timestamp") else time.time(),
            workdir=self.settings.remote.workdir,
            region=aws.region,
            instance_type=inst.get("InstanceType"),
            image_id=inst.get("ImageId"),
            image_name=(image or {}).get("Name"),
            ssh_user=self.settings.aws.ssh_user,
            key_path=str(access.key_path(self.home, spec.name, aws.region)),
        )

    def _live_instances(self, ec2: Any, cluster: str | None) -> list[dict[str, Any]]:
        filters = access.owner_filters(self.owner, cluster) + [{"Name": "instance-state-name", "Values": LIVE_STATES}]
        res = call(ec2.describe_instances, Filters=filters)
        return [i for r in res.get("Reservations", []) for i in r.get("Instances", [])]

    def endpoint(self, instance: InstanceRecord) -> Endpoint:
        """Where to SSH: the instance's public IP, port 22.

        GPUCTL_TEST_ENDPOINTS ("IP=HOST[:PORT],..."; IP may be *) exists for the end-to-end tests
        alone: moto's instances have made-up IPs, so the tests map them to a real sshd test host.
        """
        host, port = instance.public_ip or "", 22
        for pair in filter(None, os.environ.get("GPUCTL_TEST_ENDPOINTS", "").split(",")):
            ip, _, target = pair.partition("=")
            if ip in (host, "*"):
                target_ep = Endpoint.parse(target, default_user=instance.ssh_user or "ubuntu")
                host, port = target_ep.host, target_ep.port
        if not host:
            raise RemoteError(f"{instance.id} has no public IP address", "Check the subnet gives public IPs.")
        return Endpoint(user=instance.ssh_user or self.settings.aws.ssh_user, host=host, port=port)

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None,
             progress: Progress | None = None) -> SshHost:
        r = self.settings.remote
        # A new instance's sshd may accept the key only once cloud-init installed it: retry auth too.
        return SshHost(self.endpoint(instance), self.home, instance.key_path, instance.workdir, python=r.python,
                       connect_timeout_s=connect_timeout_s or r.connect_timeout_s, retry_auth=True, progress=progress)

    def _spot_steps(self, ec2: Any, inst: InstanceRecord) -> tuple[tuple[float, float], ...]:
        """The zone's spot prices over the instance's life, as (since, $/h) steps."""
        import datetime as dt

        start = dt.datetime.fromtimestamp(inst.launched_at, dt.timezone.utc)
        end = dt.datetime.fromtimestamp(inst.terminated_at or time.time(), dt.timezone.utc)
        try:
            res = call(ec2.describe_spot_price_history, InstanceTypes=[inst.instance_type], AvailabilityZone=inst.zone,
                       ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"], StartTime=start, EndTime=end)
        except CloudError:
            return ()
        points = sorted((p["Timestamp"].timestamp(), float(p["SpotPrice"])) for p in res.get("SpotPriceHistory", [])
                        if p.get("AvailabilityZone") == inst.zone)
        before = [p for p in points if p[0] <= inst.launched_at]
        after = [p for p in points if p[0] > inst.launched_at]
        # The price in force at launch is the last one published before it.
        return tuple(([(inst.launched_at, before[-1][1])] if before else []) + after)

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        """The instances as EC2 sees them now: state, and when and why they ended.

        A guard's poweroff terminates the instance (shutdown behaviour terminate); this is how the
        client learns it, and the ledger closes the billing period at EC2's time, not the client's.
        """
        by_region: dict[str, list[InstanceRecord]] = {}
        for inst in instances:
            by_region.setdefault(inst.region or "", []).append(inst)
        out = []
        for region, items in by_region.items():
            ec2 = self._aws(region or None).ec2()
            try:
                res = call(ec2.describe_instances, InstanceIds=[i.id for i in items])
                seen = {i["InstanceId"]: i for r in res["Reservations"] for i in r["Instances"]}
            except CloudError:
                seen = {}  # long gone: AWS forgets terminated instances after about an hour
            for inst in items:
                live = seen.get(inst.id)
                state = live["State"]["Name"] if live else "terminated"
                if inst.market == "spot" and inst.zone and inst.instance_type and inst.state != "terminated":
                    inst = inst.model_copy(update={"price_steps": self._spot_steps(ec2, inst) or inst.price_steps})
                if state == inst.state:
                    out.append(inst)
                    continue
                ended = None
                if state in ("terminated", "shutting-down", "stopped", "stopping"):
                    ended = _transition_time(live) if live else None
                reason = (live or {}).get("StateReason", {}).get("Message") if live else "no longer known to EC2"
                out.append(inst.model_copy(update={
                    "state": state, "state_reason": reason,
                    "terminated_at": (ended or time.time()) if state in ("terminated", "shutting-down") else None,
                    "periods": running_periods(inst, state, live, ended),
                }))
        return out

    # --- discover and release -------------------------------------------------------------------

    def regions(self, aws: Aws) -> list[str]:
        """Enabled regions of the caller's partition (DescribeRegions lists only enabled ones)."""
        partition = set(aws.session.get_available_regions("ec2"))
        names = [r["RegionName"] for r in call(aws.ec2().describe_regions)["Regions"]]
        return sorted(n for n in names if not partition or n in partition)

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        """Every live instance, security group and key pair tagged for this owner (and cluster)."""
        aws = self._aws(region)
        regions = [aws.region] if (region or cluster) else self.regions(aws)
        clients = {r: aws.ec2(r) for r in regions}  # made here: creating clients is not thread-safe
        with ThreadPoolExecutor(max_workers=8) as pool:
            found = list(pool.map(lambda r: self._discover_region(clients[r], r, cluster), regions))
        return [res for batch in found for res in batch]

    def _discover_region(self, ec2: Any, region: str, cluster: str | None) -> list[Resource]:
        filters = access.owner_filters(self.owner, cluster)
        out = [
            Resource(provider="aws", kind="instance", id=i["InstanceId"], region=region,
                     cluster=_tag(i, access.TAG_CLUSTER), state=i["State"]["Name"])
            for i in self._live_instances(ec2, cluster)
        ]
        for g in call(ec2.describe_security_groups, Filters=filters).get("SecurityGroups", []):
            out.append(Resource(provider="aws", kind="security-group", id=g["GroupId"], region=region,
                                cluster=_tag(g, access.TAG_CLUSTER)))
        for k in call(ec2.describe_key_pairs, Filters=filters).get("KeyPairs", []):
            out.append(Resource(provider="aws", kind="key-pair", id=k["KeyName"], region=region,
                                cluster=_tag(k, access.TAG_CLUSTER)))
        return out

    def release(self, resources: list[Resource], progress: Progress = _quiet) -> None:
        """Terminate instances, wait for them, then delete their groups and key pairs. Idempotent."""
        by_region: dict[str, list[Resource]] = {}
        for r in resources:
            by_region.setdefault(r.region or "", []).append(r)
        for region, items in by_region.items():
            self._release_region(region, items, progress)

    def _release_region(self, region: str, items: list[Resource], progress: Progress) -> None:
        from botocore.exceptions import ClientError

        aws = self._aws(region)
        ec2 = aws.ec2()
        instances = [r.id for r in items if r.kind == "instance"]
        if instances:
            progress(f"terminating {', '.join(instances)} in {region}")
            call(ec2.terminate_instances, InstanceIds=instances)

            def gone() -> bool:
                res = call(ec2.describe_instances, InstanceIds=instances)
                states = [i["State"]["Name"] for r in res["Reservations"] for i in r["Instances"]]
                return all(s == "terminated" for s in states)

            backoff_wait(gone, self.settings.aws.wait_timeout_s, f"{len(instances)} instance(s) to terminate", progress,
                         "They are shutting down; rerun `gpuctl down` to finish removing their groups and keys.")
        for r in items:
            if r.kind == "security-group":
                # A group stays "in use" for a while after its instances terminate.
                def deleted(gid: str = r.id) -> bool:
                    try:
                        ec2.delete_security_group(GroupId=gid)
                    except ClientError as exc:
                        if error_code(exc) == "DependencyViolation":
                            return False
                        if error_code(exc) != "InvalidGroup.NotFound":
                            raise translate(exc, "DeleteSecurityGroup") from exc
                    return True

                backoff_wait(deleted, self.settings.aws.wait_timeout_s, f"security group {r.id} to be free", progress,
                             "Rerun `gpuctl down` in a minute to finish.")
                progress(f"deleted security group {r.id}")
            elif r.kind == "key-pair":
                call(ec2.delete_key_pair, KeyName=r.id)
                progress(f"deleted key pair {r.id}")
                if r.cluster:
                    path = access.key_path(self.home, r.cluster, region)
                    path.unlink(missing_ok=True)
                    path.with_suffix(".pub").unlink(missing_ok=True)
