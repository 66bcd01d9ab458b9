"""A moto server over real HTTP for the AWS tests, looking like AWS in late 2026: only the Base OSS
Nvidia Driver GPU AMIs (loaded from MOTO_AMIS_PATH) and their SSM public parameters; instance type
validation on; a network guard that fails any test reaching a non-loopback address. Helpers add a
TensorFlow DLAMI or a baked image, and publish or withdraw a parameter."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

NETGUARD = Path(__file__).parent / "netguard"
OWNER = "898082745236"  # the DLAMIs' real owner account
ACCOUNT, REGION = "123456789012", "us-east-1"  # moto's default account; the tests' region

# AWS in late 2026: no TensorFlow DLAMI since TF 2.18, only the Base OSS Nvidia Driver GPU AMIs.
BASE_AMIS = [
    # (id, name, date, arch)
    ("ami-0ba5e0000000000a1", "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20260915", "2026-09-15", "x86_64"),
    ("ami-0ba5e0000000000a2", "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261110", "2026-11-10", "x86_64"),
    # Newer, but not what a g5 on Ubuntu 22.04 gets: another OS, another architecture.
    ("ami-0ba5e0000000000a3", "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261112", "2026-11-12", "x86_64"),
    ("ami-0ba5e0000000000a4", "Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120", "2026-11-20", "arm64"),
]
NEWEST_X86 = BASE_AMIS[1]  # what `up --type g5.xlarge` boots with the default aws.base_os
BASE_PARAMETERS = {  # the SSM public parameters AWS publishes for them, as gpuctl names them
    ("x86_64", "ubuntu-22.04"): NEWEST_X86[0],
    ("x86_64", "ubuntu-24.04"): BASE_AMIS[2][0],
    ("arm64", "ubuntu-22.04"): BASE_AMIS[3][0],
}


def ami_file(path: Path) -> Path:
    path.write_text(json.dumps([
        {
            "ami_id": ami, "name": name, "description": name, "owner_id": OWNER, "state": "available",
            "public": True, "image_location": f"amazon/{name}", "root_device_type": "ebs",
            "root_device_name": "/dev/sda1", "image_type": "machine", "architecture": arch,
            "virtualization_type": "hvm", "hypervisor": "xen", "sriov": "simple",
            "creation_date": f"{date}T00:00:00.000Z",
        }
        for ami, name, date, arch in BASE_AMIS
    ]))
    return path


def parameter_name(arch: str, base_os: str) -> str:
    from gpuctl.provision.aws.images import BASE_PARAMETER

    return BASE_PARAMETER.format(arch=arch, os=base_os)


def set_parameter(name: str, value: str) -> None:
    """Publish an SSM public parameter. moto's PutParameter refuses names under /aws/ (AccessDenied,
    as AWS does), so it goes into the in-process backend of the ThreadedMotoServer."""
    import datetime as dt

    from moto.ssm.models import Parameter, ssm_backends

    params = ssm_backends[ACCOUNT][REGION]._parameters
    params[name].append(Parameter(
        account_id=ACCOUNT, name=name, value=value, parameter_type="String", description=None, allowed_pattern=None,
        keyid=None, last_modified_date=dt.datetime.now(dt.timezone.utc), version=len(params[name]) + 1,
        data_type="aws:ec2:image"))


def remove_parameter(name: str) -> None:
    from moto.ssm.models import ssm_backends

    ssm_backends[ACCOUNT][REGION]._parameters.pop(name, None)


def publish_base_parameters() -> None:
    for (arch, base_os), ami in BASE_PARAMETERS.items():
        set_parameter(parameter_name(arch, base_os), ami)


def add_image(name: str, arch: str = "x86_64", date: str = "2026-11-25", owner: str | None = None,
              tags: dict[str, str] | None = None) -> str:
    """Put an available AMI (with its snapshot, as moto makes one per image) into the backend;
    owner None = this account's (what `Owners=["self"]` finds), else Amazon's. Its id."""
    import datetime as dt
    import secrets

    from moto.ec2.models import ec2_backends
    from moto.ec2.models.amis import Ami

    backend = ec2_backends[ACCOUNT][REGION]
    ami_id = "ami-" + secrets.token_hex(8) + "f"
    backend.amis[ami_id] = Ami(
        backend, ami_id, name=name, description=name, owner_id=owner or ACCOUNT,
        owner_alias="amazon" if owner else None, public=bool(owner), architecture=arch, virtualization_type="hvm",
        root_device_type="ebs", creation_date=dt.datetime.fromisoformat(date + "T00:00:00+00:00"), tags=tags)
    return ami_id


def add_dlami(tf: str = "2.21", arch: str = "x86_64", date: str = "2026-11-25", os_name: str = "Ubuntu 22.04") -> str:
    """A TensorFlow DLAMI of that version, as AWS named them (owner 898082745236), for Ubuntu or
    Amazon Linux 2023 (os_name "Amazon Linux 2023")."""
    return add_image(f"Deep Learning OSS Nvidia Driver AMI GPU TensorFlow {tf} ({os_name}) {date.replace('-', '')}",
                     arch, date, owner=OWNER)


def add_baked(gpuctl_owner: str, tf: str = "2.21.0", arch: str = "x86_64", date: str = "2026-11-26",
              base: str = NEWEST_X86[0], installed: str | None = None, variant: str = "cuda",
              base_os: str = "ubuntu-22.04", state: str = "available") -> str:
    """An image as `gpuctl image bake` tags it (`tf` as asked, `installed` as seen: tf unless
    said), registered in this account."""
    installed = installed or tf
    ami_id = add_image(f"gpuctl-tf{installed}-{date}", arch, date, tags={
        "gpuctl:created-by": "gpuctl", "gpuctl:owner": gpuctl_owner,
        "gpuctl:cluster": f"bake-tf{tf.replace('.', '-')}-0000", "gpuctl:tf-version": tf,
        "gpuctl:tf-installed": installed, "gpuctl:tf-variant": variant, "gpuctl:base-image": base,
        "gpuctl:base-os": base_os})
    if state != "available":
        from moto.ec2.models import ec2_backends

        ec2_backends[ACCOUNT][REGION].amis[ami_id].state = state
    return ami_id


def _route_without_disk_scans() -> None:
    """moto's server finds the backend of every request by listing its own package folder and
    stat-ing each of its ~200 entries (moto.backends.list_of_moto_modules), under one lock: a third
    of the AWS tests' CPU went there. The folder does not change while the tests run: list it once."""
    from moto import backends

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules


def _serve_without_waste() -> None:
    """Three costs of moto's server that no test looks at, a quarter of the fast tier's moto CPU:
    werkzeug logs every request at INFO (pytest's capture formats each record); moto lists a
    response class's methods with inspect.getmembers on every request; and each fresh EC2 backend
    makes EBS's default KMS key with a new 2048-bit RSA key pair, though nothing here uses it (one
    pair per key spec serves them all)."""
    import functools
    import logging

    from moto.core import responses
    from moto.kms import models as kms_models

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # moto prints "Unable to find appropriate backend for pricing..." to stdout on every Price List
    # request (it has no Pricing API): in the test process, where CliRunner captures a command's
    # stdout, it landed in the middle of `--json` output.
    from moto.moto_server import werkzeug_app

    werkzeug_app.print = lambda *args, **kwargs: None

    listed = responses.method_names_from_class
    names = functools.lru_cache(maxsize=None)(lambda cls, _attrs: listed(cls))
    # Keyed by the class's own attribute names as well: a test that adds a method sees it.
    responses.method_names_from_class = lambda cls: names(cls, frozenset(vars(cls)))
    kms_models.generate_private_key = functools.lru_cache(maxsize=None)(kms_models.generate_private_key)


def _regions_listed_once() -> None:
    """moto lists EC2's regions with a new boto3 Session at import (three times) and for each
    backend, and each new session parses EC2's service model and AWS's endpoints anew (~0.2
    CPU-seconds a time, in every worker). Any session gives the same list: one does, through
    gpuctl's shared loader, and each answer is kept."""
    import functools

    import boto3.session

    from gpuctl.provision.aws.session import _botocore_session

    shared = _botocore_session()

    @functools.lru_cache(maxsize=None)
    def listed(service: str, partition: str, allow_non_regional: bool) -> tuple[str, ...]:
        return tuple(shared.get_available_regions(service, partition, allow_non_regional))

    def get_available_regions(self, service_name, partition_name="aws", allow_non_regional=False):
        return list(listed(service_name, partition_name, allow_non_regional))

    boto3.session.Session.get_available_regions = get_available_regions


# The fake account's enabled regions, as an account may have few: `status --all` and `down --all`
# search each enabled one (four calls, and a fresh moto backend after every test's reset), and
# moto enables twenty. The others stay listed as not opted in, so that the search skips them.
ENABLED_REGIONS = (REGION, "eu-west-1", "us-west-2")


def _few_regions_enabled() -> None:
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend

    for region in RegionsAndZonesBackend.regions:
        if region.name not in ENABLED_REGIONS:
            region.opt_in_status = "not-opted-in"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    os.environ["MOTO_AMIS_PATH"] = str(ami_file(tmp_path_factory.mktemp("moto") / "amis.json"))
    os.environ["MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION"] = "true"
    from moto.server import ThreadedMotoServer

    _regions_listed_once()  # before moto's EC2 models are imported
    _route_without_disk_scans()
    _serve_without_waste()
    _few_regions_enabled()

    # On every address, so that the sshd test hosts reach S3 through their gateway as an instance
    # reaches AWS's endpoint (s3_endpoint below); this side keeps to loopback.
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    yield f"http://127.0.0.1:{port}"
    server.stop()


# The permissions boundary an administrator makes once (docs/aws-iam.md): every gpuctl role gets
# it, and `up` refuses to make a role without it.
BOUNDARY_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
     "Resource": "arn:aws:s3:::gpuctl-*/clusters/*"},
    {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::gpuctl-*"},
    # The buckets instances may read data sets from (docs/aws-iam.md): the tests' one.
    {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::training-data/*"}]}


def make_boundary() -> str:
    """The boundary policy in moto's account, as the administrator made it; its ARN."""
    from gpuctl.provision.aws.store_iam import BOUNDARY

    iam = moto_client("iam")
    return iam.create_policy(PolicyName=BOUNDARY, PolicyDocument=json.dumps(BOUNDARY_POLICY))["Policy"]["Arn"]


def s3_endpoint(moto_server: str, host) -> str:
    """The moto server as a test host reaches it (through its gateway): GPUCTL_TEST_S3_ENDPOINT."""
    return f"http://{host.gateway}:{moto_server.rsplit(':', 1)[1]}"


def s3_as_aws_does(monkeypatch) -> None:
    """moto 5.2 evaluates a bucket policy without any request context and ignores the condition
    operators it does not know (moto/iam/policy_conditions.py: only StringEquals), so the store's
    Deny on `aws:SecureTransport = false` denies every object call, TLS or not. boto3 speaks HTTPS
    to AWS, and the tests' plain-HTTP moto server stands for that: the bucket's policy is checked
    here as if the request came over TLS (that one statement left out); its text is checked in
    tests/unit/test_store.py."""
    from moto.iam.access_control import IAMPolicy
    from moto.s3.models import FakeBucket

    tls_only = {"Bool": {"aws:SecureTransport": "false"}}
    original = FakeBucket.get_permission

    def get_permission(self, action, resource):
        if self.policy is None:
            return original(self, action, resource)
        doc = json.loads(self.policy)
        statements = doc["Statement"] if isinstance(doc["Statement"], list) else [doc["Statement"]]
        doc["Statement"] = [st for st in statements if st.get("Condition") != tls_only]
        return IAMPolicy(json.dumps(doc)).is_action_permitted(action, resource)

    monkeypatch.setattr(FakeBucket, "get_permission", get_permission)


def ec2_as_aws_does(monkeypatch) -> None:
    """Two EC2 behaviours moto 5.2.5 lacks, patched into the in-process backend the ThreadedMotoServer
    serves from: StopInstances of a one-time spot instance is refused (UnsupportedOperation), and
    CreateImage tags the image's snapshots from TagSpecifications ResourceType "snapshot" (moto
    raises NotImplementedError for those)."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.amis import AmiBackend
    from moto.ec2.models.instances import InstanceBackend

    stop = InstanceBackend.stop_instances

    def stop_instances(self, instance_ids):
        for instance in self.get_multi_instances_by_id(instance_ids):
            if instance.lifecycle == "spot":  # moto's run_instances marks InstanceMarketOptions spot so
                raise EC2ClientError(
                    "UnsupportedOperation",
                    f"You can't stop the Spot Instance '{instance.id}' because it is associated with a one-time "
                    "Spot Instance request. You can only stop Spot Instances associated with persistent Spot "
                    "Instance requests.")
        return stop(self, instance_ids)

    create = AmiBackend.create_image

    def create_image(self, instance_id, name, description, tag_specifications):
        snapshot_tags = [t for spec in tag_specifications if spec["ResourceType"] == "snapshot" for t in spec["Tags"]]
        ami = create(self, instance_id, name, description,
                     [spec for spec in tag_specifications if spec["ResourceType"] != "snapshot"])
        for tag in snapshot_tags:
            ami.ebs_snapshot.add_tag(tag["Key"], tag["Value"])
        return ami

    monkeypatch.setattr(InstanceBackend, "stop_instances", stop_instances)
    monkeypatch.setattr(AmiBackend, "create_image", create_image)


def placement_groups_as_aws_does(monkeypatch) -> None:
    """moto 5.2.5 has no placement groups at all (CreatePlacementGroup is not implemented), so the
    three calls gpuctl makes are added to the EC2 responses the ThreadedMotoServer serves, with
    AWS's errors (a duplicate name, an unknown group, a group still holding instances), and
    RunInstances honours Placement.GroupName: an unknown group is refused, a known one is
    reported in the instance's Placement as DescribeInstances does on AWS."""
    from moto.core.responses import ActionResult, EmptyResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.responses import EC2Response

    def groups(response) -> dict:
        backend = response.ec2_backend
        if not hasattr(backend, "gpuctl_placement_groups"):
            backend.gpuctl_placement_groups = {}
        return backend.gpuctl_placement_groups

    def shown(name, g):
        return {"GroupName": name, "GroupId": g["id"], "State": "available", "Strategy": g["strategy"],
                "Tags": [{"Key": k, "Value": v} for k, v in g["tags"].items()]}

    def create_placement_group(self):
        name = self._get_param("GroupName")
        if name in groups(self):
            raise EC2ClientError("InvalidPlacementGroup.Duplicate", f"The Placement Group '{name}' already exists.")
        tags = self._parse_tag_specification("placement-group").get("placement-group", {})
        groups(self)[name] = {"id": f"pg-{len(groups(self)):017x}", "strategy": self._get_param("Strategy"), "tags": tags}
        return ActionResult({"PlacementGroup": shown(name, groups(self)[name])})

    def describe_placement_groups(self):
        wanted = self._filters_from_querystring()
        names = self._get_param("GroupNames", [])

        def matches(name, g):
            for key, values in wanted.items():
                if key.startswith("tag:"):
                    have = g["tags"].get(key[4:])
                else:
                    have = {"group-name": name, "state": "available", "strategy": g["strategy"]}[key]
                if have not in values:
                    return False
            return not names or name in names

        return ActionResult({"PlacementGroups": [shown(n, g) for n, g in groups(self).items() if matches(n, g)]})

    def in_group(backend, name):
        return [i for r in backend.reservations.values() for i in r.instances
                if i.placement.group_name == name and i.state != "terminated"]

    def delete_placement_group(self):
        name = self._get_param("GroupName")
        if name not in groups(self):
            raise EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        if in_group(self.ec2_backend, name):
            raise EC2ClientError("InvalidPlacementGroup.InUse", f"The Placement Group '{name}' is in use.")
        del groups(self)[name]
        return EmptyResult()

    run = EC2Response.run_instances

    def run_instances(self):
        name = self._get_param("Placement.GroupName")
        if name and name not in groups(self):
            raise EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        result = run(self)
        for inst in result.result.instances if name else ():
            inst.placement.group_name = name
        return result

    for fn in (create_placement_group, describe_placement_groups, delete_placement_group, run_instances):
        monkeypatch.setattr(EC2Response, fn.__name__, fn, raising=False)


class NonLoopbackTraffic(AssertionError):
    pass


@pytest.fixture
def aws(moto_server, monkeypatch, tmp_path):
    """boto3 pointed at the moto server, with test credentials and a fresh moto state."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(moto_server + "/moto-api/reset", method="POST")).read()
    publish_base_parameters()
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    env = {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "GPUCTL_PROVIDER": "aws",
        # moto's instances have made-up public IPs: SSH to them (status reading the watchdog) is
        # sent to a closed loopback port instead, and given up on after a second.
        "GPUCTL_TEST_ENDPOINTS": "*=127.0.0.1:9",
        "GPUCTL_REMOTE__CONNECT_TIMEOUT_S": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(NETGUARD), os.environ.get("PYTHONPATH")])),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ec2_as_aws_does(monkeypatch)
    placement_groups_as_aws_does(monkeypatch)
    s3_as_aws_does(monkeypatch)

    violations: list[str] = []
    connect = socket.socket.connect

    def guarded(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and sock.family in (socket.AF_INET, socket.AF_INET6):
            if not (host.startswith(("127.", "10.251.")) or host in ("::1", "localhost")):
                violations.append(host)
                raise NonLoopbackTraffic(f"test network guard: connection to non-loopback {host}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    make_boundary()
    yield moto_client("ec2")
    assert not violations, f"tests must not leave loopback: {violations}"


def boto3_session():
    """A boto3 session for the tests' own look at moto, reading AWS's service models through
    gpuctl's shared loader (a new loader parses EC2's megabytes of JSON again, every test)."""
    import boto3

    from gpuctl.provision.aws.session import _botocore_session

    return boto3.session.Session(region_name=REGION, botocore_session=_botocore_session())


_CLIENTS: dict[tuple[str, str], object] = {}


def moto_client(service: str):
    """The tests' own client of a service on this worker's moto server, made once (a session and
    a client per test were a tenth of the AWS tests' CPU). It keeps the test credentials it was made
    with: a test that takes gpuctl's away still looks with it."""
    key = (service, os.environ["AWS_ENDPOINT_URL"])
    if key not in _CLIENTS:
        _CLIENTS[key] = boto3_session().client(service)
    return _CLIENTS[key]


def live_instances(ec2, **filters):
    res = ec2.describe_instances(Filters=[
        {"Name": "tag:gpuctl:created-by", "Values": ["gpuctl"]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped", "shutting-down"]},
    ])
    return [i for r in res["Reservations"] for i in r["Instances"]]


def gpuctl_groups(ec2):
    return ec2.describe_security_groups(Filters=[{"Name": "tag:gpuctl:created-by", "Values": ["gpuctl"]}])["SecurityGroups"]


def gpuctl_keys(ec2):
    return ec2.describe_key_pairs(Filters=[{"Name": "tag:gpuctl:created-by", "Values": ["gpuctl"]}])["KeyPairs"]


def gpuctl_profiles():
    """The roles and instance profiles gpuctl made (under its IAM path), by name."""
    iam = moto_client("iam")
    return sorted({r["RoleName"] for r in iam.list_roles(PathPrefix="/gpuctl/")["Roles"]}
                  | {p["InstanceProfileName"] for p in iam.list_instance_profiles(PathPrefix="/gpuctl/")["InstanceProfiles"]})


def nothing_created(ec2):
    assert live_instances(ec2) == [] and gpuctl_groups(ec2) == [] and gpuctl_keys(ec2) == []
    assert gpuctl_profiles() == []


def user_data(aws, instance_id: str) -> str:
    """The boot script an instance was launched with (gzipped by gpuctl, base64 by EC2)."""
    import base64
    import gzip

    raw = base64.b64decode(aws.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")["UserData"]["Value"])
    assert len(raw) <= 16384, "EC2 takes 16 KB of user data at most"
    return gzip.decompress(raw).decode()
