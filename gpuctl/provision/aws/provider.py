"""The `aws` provider: EC2 GPU instances, found by their tags, never by local memory, so an `up`
killed at any moment leaves nothing that `gpuctl status --all` cannot see and
`gpuctl down --all -y` cannot remove."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpuctl import seams
from gpuctl.config.settings import Settings
from gpuctl.errors import CloudError, ConfigError, GpuctlError, NoCapacityError, RemoteError
from gpuctl.model import billing, untrusted
from gpuctl.model.endpoint import Endpoint
from gpuctl.model.data import S3Listing
from gpuctl.model.records import ENDED_STATES, InstanceRecord, PriceQuote, Resource
from gpuctl.model.specs import AwsSpec, Capabilities, RunFiles
from gpuctl.payloads.gpuctl_protocol import POWEROFF
from gpuctl.provision import ProviderBase, ignore_launched, remote_spec
from gpuctl.provision.aws import access, budget, catalog, images, inventory, lifecycle, nodes, records, store_iam
from gpuctl.provision.aws.baked import AwsImages
from gpuctl.provision.aws.context import AwsContext
from gpuctl.provision.aws.launch import LaunchPlan
from gpuctl.provision.aws.session import Aws, call, translate, wait_for
from gpuctl.provision.aws.snapshots import S3Snapshots
from gpuctl.provision.aws.store import S3Store
from gpuctl.provision.aws.userdata import HARD_CAP_MARK, boot_script
from gpuctl.provision.aws.volumes import AwsVolumes
from gpuctl.remote import guard
from gpuctl.remote.host import Host
from gpuctl.remote.ssh.host import SshHost

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _from_botocore(exc: BaseException) -> bool:
    if type(exc).__module__.startswith(("botocore.", "boto3.")):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(("botocore.", "boto3."))


class AwsProvider(ProviderBase):
    name = "aws"

    @staticmethod
    def foreign_error(exc: BaseException) -> GpuctlError | None:
        """botocore's exception that a call site left untranslated, as the cloud's error; also one
        raised inside botocore (an HTML page answered with a 200 ends in a KeyError there)."""
        return translate(exc) if _from_botocore(exc) else None
    # `up` again on a live cluster finds it by tag and reuses it; the watchdog from `up` on (billed by
    # the second from then); on fire it powers off (shutdown behaviour terminate: that ends the bill).
    capabilities = Capabilities(reuses_live_clusters=True, arms_guard_at_up=True, default_on_fire=POWEROFF,
                                boot_hard_cap=True, picks_instance_types=True)

    def __init__(self, home: Path, spec: AwsSpec):
        self.ctx = AwsContext(home, spec)
        self.home = self.ctx.home
        self.spec = spec
        self._on_demand_price: tuple[float, str] | None = None

    @classmethod
    def spec_from_settings(cls, s: Settings, usd_per_hour: float | None = None) -> AwsSpec:
        if usd_per_hour is not None:
            raise ConfigError("--usd-per-hour is for local and ssh clusters",
                              "On aws the price comes from AWS (spot price history, or the on-demand list price).")
        a = s.aws
        return AwsSpec(
            name=s.cluster, instance_type=a.instance_type, market=a.market,
            max_price=a.max_price or None, image=a.image or None, region=a.region or None, disk_gb=a.disk_gb,
            launch_token=secrets.token_hex(8), profile=a.profile or None, fallback_on_demand=a.fallback_on_demand,
            image_pattern=a.image_pattern, base_os=a.base_os, tensorflow=s.train.tensorflow, ssh_cidr=a.ssh_cidr, ssh_user=a.ssh_user, wait_timeout_s=a.wait_timeout_s,
            max_hours=s.guards.max_hours, remote=remote_spec(s), billing="per-second", checkpoints=a.checkpoints,
            checkpoint_expiry_days=a.checkpoint_expiry_days, checkpoint_versions_days=a.checkpoint_versions_days,
            imds_endpoint=a.imds_endpoint, imds_poll_s=a.imds_poll_s, imds_hop_limit=2 if a.imds_for_containers else 1,
            store_id=secrets.token_hex(6), zones=(a.zone,) if a.zone else (),
            nodes=s.nodes, placement=a.placement,
            boot_guard={"idle_s": s.guards.seconds("idle"), "check_interval_s": s.guards.seconds("check_interval"),
                        "gpu_idle_percent": s.guards.gpu_idle_percent, "on_fire": s.guards.on_fire or cls.capabilities.default_on_fire,
                        "poweroff_command": s.guards.poweroff_command},
        )

    def check(self) -> None:
        """Credentials and region, before `up` records anything: a launch that cannot even ask AWS
        must leave no cluster behind."""
        self.aws(self.spec.region)

    def price_quote(self) -> PriceQuote:
        """Spot: the cheapest offering zone's current price (the zone tried first); on-demand (or
        spot falling back to it): the list price. Times the nodes."""
        spec = self.spec
        aws = self.aws(spec.region)
        catalog.instance_type_info(aws, spec.instance_type, spec.image is not None)  # a typo: did-you-mean first
        if spec.market == "spot":
            offered = set(self._zones(catalog.zones_offering(aws, spec.instance_type), aws.region))
            prices = {z: p for z, p in catalog.spot_prices(aws, spec.instance_type).items() if z in offered}
            if prices or not spec.fallback_on_demand:
                if not prices:
                    raise catalog.no_spot_offering(spec.instance_type, aws.region)
                catalog.refuse_unmeetable_cap(spec.instance_type, aws.region, prices, spec.max_price)
                zone, usd = min(prices.items(), key=lambda kv: kv[1])
                cap, cap_source = self._spot_cap(aws)
                return PriceQuote(usd_per_hour=usd * spec.nodes, nodes=spec.nodes, market="spot",
                                  source=f"spot price in {zone} now", max_price=cap, cap_source=cap_source)
        usd, source = self._on_demand(aws)
        return PriceQuote(usd_per_hour=usd * spec.nodes, nodes=spec.nodes, market="on-demand", source=source)

    def _spot_cap(self, aws: Aws) -> tuple[float, str]:
        """The highest spot $/h a node may be billed, and who set it."""
        if self.spec.max_price:
            return self.spec.max_price, "--max-price"
        return self._on_demand(aws)[0], "the on-demand price, AWS's default"

    def _on_demand(self, aws: Aws) -> tuple[float, str]:
        """The type's on-demand ($/h, source), looked up once for the question and the launch."""
        if self._on_demand_price is None:
            self._on_demand_price = catalog.on_demand_price(aws, self.spec.instance_type, self.home / "cache")
        return self._on_demand_price

    @property
    def owner(self) -> str:
        return self.ctx.owner

    def aws(self, region: str | None = None) -> Aws:
        return self.ctx.aws(region)

    # --- launch ---------------------------------------------------------------------------------

    def launch(self, progress: Progress = _quiet, wait_ssh: bool = True,
               launched: Callable[[InstanceRecord], None] = ignore_launched) -> list[InstanceRecord]:
        try:
            return self._launch(progress, wait_ssh, launched)
        finally:  # `up` and a replacement alike: the budget's stop action names what runs now
            budget.sync(self.home, self.spec.profile or "", progress)

    def _launch(self, progress: Progress, wait_ssh: bool,
                launched: Callable[[InstanceRecord], None]) -> list[InstanceRecord]:
        spec = self.spec
        aws = self.aws(spec.region)
        # One on its way out (a spot instance EC2 is ending) is no instance to reuse.
        existing = [i for i in self.live_instances(aws.ec2(), spec.name) if i["State"]["Name"] != "shutting-down"]
        if existing:
            ranked = nodes.reusable(existing, spec.nodes, spec.name)
            cidr = self._ssh_source(progress)
            found = ", ".join(f"{i['InstanceId']} ({i['State']['Name']})" for i in ranked)
            progress(f"reusing {found}, found by {'its' if len(ranked) == 1 else 'their'} tags")
            self._open_ssh(aws, ranked[0]["VpcId"], cidr, progress)
            if spec.volume is not None:  # attached at the `up` that launched it; again if it was not
                self.volume_store().attach(spec.volume, ranked[0]["InstanceId"], progress)
            return [records.describe(self.home, spec, aws.region, i, None, "recorded at launch") for i in ranked]

        # Check everything that can be checked before creating anything.
        info = catalog.instance_type_info(aws, spec.instance_type, spec.image is not None)
        arch = catalog.architecture(info)
        gpus = bool(info.get("GpuInfo", {}).get("Gpus"))
        if not gpus:
            progress(f"warning: {spec.instance_type} has no GPU: training runs on its CPU, slowly, and `gpuctl train` "
                     f"refuses it without --allow-cpu (GPU types: {catalog.suggested_types()})")
        chosen = images.resolve(aws, spec, arch, self.owner, gpus)
        progress(f"image {chosen.name} ({chosen.id}, {chosen.image.get('CreationDate', '?')[:10]}): {chosen.why}")
        zones = catalog.zones_offering(aws, spec.instance_type)
        if not zones:
            raise NoCapacityError(
                f"{spec.instance_type} is not offered in any zone of {aws.region}", "Try another region (--region)."
            )
        zones = self._zones(zones, aws.region)
        market = spec.market
        spot = catalog.spot_prices(aws, spec.instance_type) if market == "spot" else {}
        if market == "spot" and not spot:
            if not spec.fallback_on_demand:
                raise catalog.no_spot_offering(spec.instance_type, aws.region)
            progress(f"{spec.instance_type} has no spot offering in {aws.region}: falling back to on-demand")
            market = "on-demand"
        if market == "spot":
            zones = sorted(zones, key=lambda z: spot.get(z, float("inf")))
            catalog.refuse_unmeetable_cap(spec.instance_type, aws.region, {z: spot[z] for z in zones if z in spot},
                                          spec.max_price)
            # No second price lookup here: the question before launch said the on-demand price.
            progress(f"spot price cap in force: ${spec.max_price:.4f}/h a node (--max-price)" if spec.max_price
                     else "spot price cap in force: the on-demand price a node (AWS's default)")
        cidr = self._ssh_source(progress)
        vpc = access.default_vpc(aws)
        subnets = access.zone_subnets(aws, vpc)
        ordered = {z: subnets[z] for z in zones if z in subnets}
        if not ordered:
            raise CloudError(f"the default VPC has no subnet in the zones offering {spec.instance_type}: {', '.join(zones)}")

        # From here on, resources exist; each is tagged as it is created. The checkpoint store's
        # instance profile comes first: a caller without the IAM permissions is refused before
        # anything else is made.
        store = self.checkpoint_store()
        profile = store.prepare(spec.name, spec.store_place, progress)[1] if store is not None else ""
        key_name, key_path = access.ensure_key_pair(aws, self.home, spec.name, self.owner)
        progress(f"key pair {key_name} (private key {key_path}, 0600)")
        group = self._open_ssh(aws, vpc, cidr, progress)
        placement = ""
        if spec.placement == "cluster":
            placement = nodes.ensure_placement_group(aws, spec.name, self.owner)
            progress(f"placement group {placement} (strategy cluster: the nodes on one low-latency network)")
        plan = LaunchPlan(
            cluster=spec.name, owner=self.owner, instance_type=spec.instance_type, image_id=chosen.id,
            root_device=chosen.image.get("RootDeviceName", "/dev/sda1"), key_name=key_name, security_group=group,
            subnets=ordered, market=market, max_price=spec.max_price or 0.0,
            fallback_on_demand=spec.fallback_on_demand, disk_gb=spec.disk_gb,
            user_data=boot_script(spec.max_hours, spec.boot_guard, spec.ssh_user, spec.remote.workdir),
            token_seed=f"{self.owner}|{spec.name}|{spec.launch_token}", instance_profile=profile,
            nodes=spec.nodes, placement_group=placement, wait_timeout_s=spec.wait_timeout_s,
            imds_hop_limit=spec.imds_hop_limit,
        )
        # What a node may bill, known before it exists: EC2's answer to RunInstances is recorded
        # (`launched`) with its price at once, no lookup between the two.
        on_demand = self._on_demand(aws) if market == "on-demand" or spec.fallback_on_demand else None

        def price(zone: str, used: str) -> tuple[float, str]:
            if used == "spot":
                return spot.get(zone) or catalog.spot_prices(aws, spec.instance_type).get(zone, 0.0), "spot price history"
            return on_demand or self._on_demand(aws)

        cap = (spec.max_price or self._on_demand(aws)[0]) if market == "spot" else None
        told = records.Launch(self.home, spec, aws.region, chosen, price, cap, launched)
        made, used = nodes.launch_nodes(aws, plan, progress, told.made, told.ended)
        ids = [i["InstanceId"] for i in made]
        zone = made[0]["Placement"]["AvailabilityZone"]
        progress(f"launched {', '.join(ids)} ({used}) in {zone}")
        running = told.running(sorted(self.wait_running(aws, ids, progress), key=nodes.rank))
        if spec.volume is not None:  # the chief's; its termination detaches it (DeleteOnTermination false)
            self.volume_store().attach(spec.volume, running[0].id, progress)
        if wait_ssh and len(running) == 1:  # in this thread: a caller's progress may use its own sqlite
            running = [self._first_login(running[0], progress)]
        elif wait_ssh:
            # One login per node, at once: each waits for its own sshd and cloud-init.
            with ThreadPoolExecutor(max_workers=min(8, len(running))) as pool:
                running = list(pool.map(lambda r: self._first_login(r, progress), running))
        return running

    def _zones(self, offering: list[str], region: str) -> list[str]:
        """The zones a launch may use: a volume's (`up --volume`), else --zone's, else all offering."""
        spec = self.spec
        allowed = (spec.volume.zone,) if spec.volume is not None else spec.zones
        if not allowed:
            return offering
        kept = [z for z in offering if z in allowed]
        if not kept:
            why = f"the zone of volume {spec.volume.name!r}" if spec.volume is not None else "--zone"
            raise ConfigError(f"{spec.instance_type} is not offered in {', '.join(allowed)} ({why}) in {region}",
                              f"Zones offering it: {', '.join(offering)}; pick another --type, or "
                              + ("a volume in one of those zones." if spec.volume is not None else "another --zone."))
        return kept

    def _ssh_source(self, progress: Progress) -> str:
        cidr, wide = access.ssh_cidr(self.spec.ssh_cidr)
        if wide:
            progress(f"WARNING: SSH is open to {wide} because you asked for it")
        return cidr

    def _open_ssh(self, aws: Aws, vpc: str, cidr: str, progress: Progress) -> str:
        group, revoked = access.ensure_security_group(aws, vpc, self.spec.name, self.owner, cidr)
        for rule in revoked:
            progress(f"security group {group}: revoked {rule} (not asked for now)")
        progress(f"security group {group}: SSH from {cidr} only")
        return group

    def wait_running(self, aws: Aws, ids: list[str], progress: Progress) -> list[dict[str, Any]]:
        """Wait until every instance runs; their descriptions (addresses known by then)."""
        names = ", ".join(ids)
        progress(f"waiting for {names} to run")
        wait_for(aws.ec2(), "instance_running", self.spec.wait_timeout_s, what=f"{names} to run",
                 hint=f"{names} may still start: `gpuctl status --all`; `gpuctl down -y` releases them.", InstanceIds=ids)
        res = call(aws.ec2().describe_instances, InstanceIds=ids)
        return [i for r in res["Reservations"] for i in r["Instances"]]

    def _first_login(self, record: InstanceRecord, progress: Progress) -> InstanceRecord:
        """Log in once: proves SSH works with the cluster's key, pins the host key, and confirms
        the boot-time hard cap."""
        host = self.host(record, progress=progress)
        host.run(["mkdir", "-p", record.workdir], cwd=False)
        record = record.model_copy(update={"workdir": host.root})
        progress(f"SSH works: {host.label}, host key pinned")
        cap = host.read_bytes(HARD_CAP_MARK, 0, 200)
        if cap:
            at, _, how = cap.decode("utf-8", "replace").strip().partition(" ")
            when = untrusted.number(at, float, untrusted.EARLIEST, untrusted.LATEST)  # the instance's word
            progress(f"hard cap armed ({how}): powers off at "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(when)) if when else '?'}")
        else:
            progress(f"WARNING: the boot-time hard cap is not confirmed yet ({HARD_CAP_MARK} missing; cloud-init "
                     "may still be running); the watchdog enforces max_hours as well")
        host.close()
        return record

    def live_instances(self, ec2: Any, cluster: str | None, every_owner: bool = False) -> list[dict[str, Any]]:
        return self.ctx.live_instances(ec2, cluster, every_owner)

    def endpoint(self, instance: InstanceRecord) -> Endpoint:
        """Where to SSH: the instance's public IP, port 22 (the tests redirect it: gpuctl.seams)."""
        host, port = instance.public_ip or "", 22
        target = seams.endpoint_override(host, instance.node, instance.instance_type or "")
        if target:
            ep = Endpoint.parse(target, default_user=instance.ssh_user or "ubuntu")
            host, port = ep.host, ep.port
        if not host:
            raise RemoteError(f"{instance.id} has no public IP address", "Check the subnet gives public IPs.")
        return Endpoint(user=instance.ssh_user or self.spec.ssh_user, host=host, port=port,
                        key_alias=access.key_alias(instance.id))

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None,
             progress: Progress | None = None) -> SshHost:
        r = self.spec.remote
        # A new instance's sshd may accept the key only once cloud-init installed it: retry auth too.
        return SshHost(self.endpoint(instance), self.home, instance.key_path, instance.workdir, python=r.python,
                       connect_timeout_s=connect_timeout_s or r.connect_timeout_s, retry_auth=True, progress=progress,
                       tmux_socket=instance.tmux_socket, command_timeout_s=r.command_timeout_s)

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        return lifecycle.reconcile(self.aws, instances)

    def set_hard_cap(self, host: Host, hours: float) -> bool:
        return guard.set_hard_cap(host, hours)

    def remember(self, instances: list[InstanceRecord]) -> None:
        pass  # the instances' tags are EC2's view; the work dir is the ledger's alone

    def kept_run(self, run_id: str) -> tuple[Host, str] | None:
        return None  # what outlives the instance is in the checkpoint store

    def run_files(self) -> RunFiles:
        return RunFiles(kept="in_store" if self.spec.checkpoints == "s3" else "on_instance")

    def was_interrupted(self, instance: InstanceRecord) -> bool:
        """EC2 ended it for spot capacity (state reason Server.SpotInstanceTermination). Not a user's
        or a guard's shutdown (Client.*), and not an instance merely gone from DescribeInstances
        (EC2 forgets terminated ones after about an hour: a guard may have ended it)."""
        reason = instance.state_reason or ""
        return instance.state in ENDED_STATES and reason.startswith(billing.SPOT_INTERRUPTION_REASON)

    def end_interrupted(self, instances: list[InstanceRecord], progress: Progress = _quiet,
                        taken: set[str] | None = None) -> list[InstanceRecord]:
        """Spot instances interrupted in their first hour get EC2's grace (lifecycle.py)."""
        return lifecycle.end_interrupted(instances, self.reconcile, lambda i: self._end(i, progress), progress, taken,
                                         self.aws(self.spec.region).clock)

    def _end(self, instances: list[InstanceRecord], progress: Progress) -> list[InstanceRecord]:
        if not instances:
            return []

        self.release([Resource(provider=self.name, kind="instance", id=i.id, region=i.region, cluster=i.cluster)
                       for i in instances], progress)
        return self.reconcile(instances)

    def interruption_notice(self) -> dict[str, Any] | None:
        """Spot instances hear of their interruption two minutes ahead through IMDSv2
        (spot/instance-action); EC2 recommends polling it every 5 seconds (aws.imds_poll_s)."""
        if self.spec.market != "spot" or not self.spec.imds_endpoint:
            return None
        return {"endpoint": self.spec.imds_endpoint, "interval_s": self.spec.imds_poll_s}

    def checkpoint_store(self) -> S3Store | None:
        """The owner's S3 bucket of the region (provision/aws/store.py) when the cluster keeps its
        checkpoints there (`aws.checkpoints = "s3"`); None: they stay on the instance's disk."""
        if self.spec.checkpoints != "s3":
            return None
        return S3Store(self.ctx)

    def data_region(self) -> str | None:
        return self.spec.region or self.ctx.aws().region  # the region its instances run in

    def data_access(self, listing: S3Listing, progress: Progress = _quiet) -> dict[str, Any] | None:
        """With an instance profile (`aws.checkpoints = "s3"`): its role may read exactly this
        data set's objects from now on, and the instance signs its own GETs with the role's
        credentials (IMDSv2); else (or where IAM refuses) None: links made on this machine."""
        if self.spec.checkpoints != "s3" or not self.spec.imds_endpoint:
            return None
        source = listing.source
        store = S3Store(self.ctx)  # whose region named the role at `up`
        why = store_iam.grant_data(self.ctx.aws(), self.owner, self.spec.name, store.region, source.bucket,
                                   source.prefix, store.partition)
        if why is not None:
            progress(f"data: {why}: the instance fetches with links made here instead")
            return None
        endpoint = seams.s3_endpoint() or f"https://s3.{listing.region}.amazonaws.com"
        progress(f"data: the cluster's role may read {source.url} (s3:GetObject, that prefix only)")
        return {"imds": self.spec.imds_endpoint, "bucket": source.bucket, "prefix": source.prefix,
                "region": listing.region, "endpoint": endpoint,
                "virtual": seams.s3_endpoint() is None and "." not in source.bucket}

    def image_store(self) -> AwsImages:
        return AwsImages(self.ctx)

    def volume_store(self) -> AwsVolumes:
        return AwsVolumes(self.ctx)

    def snapshot_store(self) -> S3Snapshots:
        return S3Snapshots(self.ctx)

    def mount_volume(self, host: Host) -> tuple[str, str]:
        assert self.spec.volume is not None, "only a cluster of `up --volume` mounts one"
        return self.volume_store().mount(host, self.spec.volume, self.spec.ssh_user)

    # --- discover and release: provision/aws/inventory.py ----------------------------------------

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Any]:
        return inventory.discover(self.ctx, cluster, region)

    def release(self, resources: list[Any], progress: Progress = _quiet, unreachable: frozenset[str] = frozenset()) -> None:
        try:
            inventory.release(self.ctx, resources, progress)
        finally:  # what was released leaves the budget's stop action (never holding `down`: sync says, not raises)
            budget.sync(self.home, self.spec.profile or "", progress)


if TYPE_CHECKING:
    from gpuctl.provision import Provider

    _keeps_the_contract: type[Provider] = AwsProvider  # checked by mypy (scripts/typecheck)
