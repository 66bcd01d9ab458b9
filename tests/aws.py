"""A moto server over real HTTP for the AWS tests, with DLAMIs loaded from MOTO_AMIS_PATH, instance
type validation on, and a network guard that fails any test reaching a non-loopback address."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

NETGUARD = Path(__file__).parent / "netguard"
OWNER = "898082745236"  # the DLAMIs' real owner account

DLAMIS = [
    # (id, name, date, arch)
    ("ami-0d1a00000000000a1", "Deep Learning AMI GPU TensorFlow 2.15 (Ubuntu 20.04) 20240115", "2024-01-15", "x86_64"),
    ("ami-0d1a00000000000a2", "Deep Learning OSS Nvidia Driver AMI GPU TensorFlow 2.16 (Ubuntu 22.04) 20240601", "2024-06-01", "x86_64"),
    ("ami-0d1a00000000000a3", "Deep Learning OSS Nvidia Driver AMI GPU TensorFlow 2.18 (Ubuntu 22.04) 20250301", "2025-03-01", "x86_64"),
    # Newer, but not for a g5: the wrong architecture, and an image that is not the TF DLAMI.
    ("ami-0d1a00000000000a4", "Deep Learning ARM64 AMI GPU TensorFlow 2.18 (Ubuntu 22.04) 20250401", "2025-04-01", "arm64"),
    ("ami-0d1a00000000000a5", "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20250501", "2025-05-01", "x86_64"),
]
NEWEST_X86 = DLAMIS[2]


def ami_file(path: Path) -> Path:
    path.write_text(json.dumps([
        {
            "ami_id": ami, "name": name, "description": name, "owner_id": OWNER, "state": "available",
            "public": True, "image_location": f"amazon/{name}", "root_device_type": "ebs",
            "root_device_name": "/dev/sda1", "image_type": "machine", "architecture": arch,
            "virtualization_type": "hvm", "hypervisor": "xen", "sriov": "simple",
            "creation_date": f"{date}T00:00:00.000Z",
        }
        for ami, name, date, arch in DLAMIS
    ]))
    return path


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    os.environ["MOTO_AMIS_PATH"] = str(ami_file(tmp_path_factory.mktemp("moto") / "amis.json"))
    os.environ["MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION"] = "true"
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class NonLoopbackTraffic(AssertionError):
    pass


@pytest.fixture
def aws(moto_server, monkeypatch, tmp_path):
    """boto3 pointed at the moto server, with test credentials and a fresh moto state."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(moto_server + "/moto-api/reset", method="POST")).read()
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
    import boto3

    yield boto3.session.Session(region_name="us-east-1").client("ec2")
    assert not violations, f"tests must not leave loopback: {violations}"


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


def nothing_created(ec2):
    assert live_instances(ec2) == [] and gpuctl_groups(ec2) == [] and gpuctl_keys(ec2) == []
