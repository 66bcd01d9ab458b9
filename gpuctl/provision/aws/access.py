"""Who may reach an instance: gpuctl's tags, a per-cluster ed25519 key pair (the private half never
leaves this machine), and a per-cluster security group open for SSH to the caller's address only."""

from __future__ import annotations

import getpass
import hashlib
import ipaddress
import os
import secrets
import socket
import urllib.request
from pathlib import Path
from typing import Any

from gpuctl.errors import CloudError, ConfigError
from gpuctl.files import write_private
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate

TAG_CLUSTER = "gpuctl:cluster"
TAG_OWNER = "gpuctl:owner"
TAG_CREATED_BY = "gpuctl:created-by"
TAG_NODE = "gpuctl:node"  # an instance's rank in its cluster (0 = the chief), set at creation
CHECKIP_URL = "https://checkip.amazonaws.com"


def owner_id(home: Path) -> str:
    """Who this gpuctl install is, as `user@host-xxxxxx`; made once and kept under the home.

    `--all` operations touch only resources carrying this owner tag, so two people sharing an
    AWS account never release each other's instances. Several first runs at once must agree on
    one id (a resource tagged with a losing id would be another owner's), so the file is written
    aside and hard-linked into place: linking never replaces a file, and the name only ever
    shows a complete one.
    """
    path = home / "owner"
    try:
        return _read_owner(path)
    except FileNotFoundError:
        pass
    value = f"{getpass.getuser()}@{socket.gethostname().split('.')[0]}-{secrets.token_hex(3)}"
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".owner.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another first run won: its id is the one
    finally:
        tmp.unlink(missing_ok=True)
    return _read_owner(path)


def _read_owner(path: Path) -> str:
    value = path.read_text().strip()
    if not value:  # an older gpuctl could leave it empty when killed while writing it
        raise ConfigError(f"{path} is empty, so this install has no owner id",
                          f"Remove {path}; `gpuctl status --all` then lists what the old id tagged as another owner's.")
    return value


def key_alias(instance_id: str) -> str:
    """The name an instance's host key is pinned under: EC2 recycles public IPs, so an address
    names no machine for long; the pin goes at `down`."""
    return f"gpuctl-{instance_id}"


def tags(cluster: str, owner: str) -> list[dict[str, str]]:
    return [
        {"Key": TAG_CLUSTER, "Value": cluster},
        {"Key": TAG_OWNER, "Value": owner},
        {"Key": TAG_CREATED_BY, "Value": "gpuctl"},
        {"Key": "Name", "Value": f"gpuctl-{cluster}"},
    ]


def tag_spec(resource_type: str, cluster: str, owner: str, node: int | None = None) -> dict[str, Any]:
    extra = [] if node is None else [{"Key": TAG_NODE, "Value": str(node)}]
    return {"ResourceType": resource_type, "Tags": tags(cluster, owner) + extra}


def owner_filters(owner: str | None, cluster: str | None = None) -> list[dict[str, Any]]:
    """gpuctl's resources of this owner (None: of every owner in the account), and cluster."""
    filters = [{"Name": f"tag:{TAG_CREATED_BY}", "Values": ["gpuctl"]}]
    if owner is not None:
        filters.append({"Name": f"tag:{TAG_OWNER}", "Values": [owner]})
    if cluster:
        filters.append({"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]})
    return filters


def resource_name(cluster: str, owner: str) -> str:
    """Key pair and security group name: unique per owner, readable in the console."""
    return f"gpuctl-{cluster}-{hashlib.sha1(owner.encode()).hexdigest()[:8]}"


def key_path(home: Path, cluster: str, region: str) -> Path:
    return home / "keys" / f"{cluster}.{region}.pem"


def ensure_key_pair(aws: Aws, home: Path, cluster: str, owner: str) -> tuple[str, Path]:
    """Generate an ed25519 key locally (0600) and import its public half, tagged; reuse both if present."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ec2 = aws.ec2()
    name = resource_name(cluster, owner)
    path = key_path(home, cluster, aws.region)
    existing = call(ec2.describe_key_pairs, Filters=[{"Name": "key-name", "Values": [name]}]).get("KeyPairs", [])
    if existing and path.exists():
        return name, path
    if existing:  # the private half is gone: that key can never log in again
        call(ec2.delete_key_pair, KeyName=name)
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, private)
    path.with_suffix(".pub").write_bytes(public + b"\n")
    call(ec2.import_key_pair, KeyName=name, PublicKeyMaterial=public, TagSpecifications=[tag_spec("key-pair", cluster, owner)])
    return name, path


def caller_cidr(timeout_s: float = 5.0) -> str | None:
    """This machine's public address as /32 (or /128), asked of AWS's checkip; None if unknown."""
    try:
        with urllib.request.urlopen(CHECKIP_URL, timeout=timeout_s) as resp:  # noqa: S310 - fixed https URL
            text = resp.read(64).decode().strip()
        ip = ipaddress.ip_address(text)
    except (OSError, ValueError):
        return None
    return f"{ip}/{32 if ip.version == 4 else 128}"


# The widest range `up` opens SSH to without a warning: a /16 (65,536 addresses) for IPv4, one
# site's /48 for IPv6. Anything wider is a good part of the internet, not "my office".
WIDEST_QUIET = {4: 16, 6: 48}


def ssh_cidr(configured: str, detect: bool = True) -> tuple[str, str | None]:
    """(CIDR allowed to SSH in, how wide it is when wider than WIDEST_QUIET: the warning's words,
    else None). Refuses when nothing is known."""
    if configured:
        net = ipaddress.ip_network(configured, strict=False)
        if net.prefixlen >= WIDEST_QUIET[net.version]:
            return str(net), None
        return str(net), (f"the whole internet ({net})" if net.prefixlen == 0 else f"{net.num_addresses:,} addresses ({net})")
    found = caller_cidr() if detect else None
    if not found:
        raise ConfigError(
            "could not detect this machine's public IP address to open SSH to it alone",
            "Pass --ssh-cidr YOUR.IP.ADDRESS/32 (or set `[aws] ssh_cidr`).",
        )
    return found, None


def default_vpc(aws: Aws) -> str:
    vpcs = call(aws.ec2().describe_vpcs, Filters=[{"Name": "isDefault", "Values": ["true"]}]).get("Vpcs", [])
    if not vpcs:
        raise CloudError(
            f"no default VPC in {aws.region}",
            "Create one with `aws ec2 create-default-vpc`, or use another region.",
        )
    return vpcs[0]["VpcId"]


def zone_subnets(aws: Aws, vpc_id: str) -> dict[str, str]:
    """Zone -> the VPC's default subnet there (public IPs on launch)."""
    subnets = call(
        aws.ec2().describe_subnets,
        Filters=[{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "default-for-az", "Values": ["true"]}],
    ).get("Subnets", [])
    return {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}


def ensure_security_group(aws: Aws, vpc_id: str, cluster: str, owner: str, cidr: str) -> tuple[str, list[str]]:
    """A group per cluster: SSH from `cidr` only, plus all traffic between the cluster's own nodes.

    A group found again (an `up` killed earlier, a cluster whose instance ended) is set to exactly
    that: what an earlier `up` opened, to the world say, must not outlive the question. Returns the
    group and the rules revoked, as "tcp 22 from 0.0.0.0/0"."""
    ec2 = aws.ec2()
    name = resource_name(cluster, owner)
    found = call(
        ec2.describe_security_groups,
        Filters=[{"Name": "group-name", "Values": [name]}, {"Name": "vpc-id", "Values": [vpc_id]}],
    ).get("SecurityGroups", [])
    if found:
        group_id, have = found[0]["GroupId"], found[0].get("IpPermissions", [])
    else:
        group_id, have = call(
            ec2.create_security_group,
            GroupName=name,
            Description=f"gpuctl cluster {cluster}: SSH from the owner's address only",
            VpcId=vpc_id,
            TagSpecifications=[tag_spec("security-group", cluster, owner)],
        )["GroupId"], []
    return group_id, _set_ingress(ec2, group_id, have, cidr)


# One ingress rule, comparable: (protocol, from port, to port, source field, source).
Rule = tuple[str, Any, Any, str, str]
_SOURCE_KEY = {"IpRanges": "CidrIp", "Ipv6Ranges": "CidrIpv6", "UserIdGroupPairs": "GroupId",
               "PrefixListIds": "PrefixListId"}


def _rules(permissions: list[dict[str, Any]]) -> dict[Rule, dict[str, Any]]:
    """Each rule of a group's IpPermissions, with its source entry as EC2 gave it (a group of
    another account needs its UserId to be revoked)."""
    out = {}
    for p in permissions:
        proto = str(p.get("IpProtocol"))
        ports = (None, None) if proto == "-1" else (p.get("FromPort"), p.get("ToPort"))
        for field, key in _SOURCE_KEY.items():
            for src in p.get(field, []):
                if src.get(key):
                    out[(proto, *ports, field, src[key])] = {k: v for k, v in src.items() if k != "Description"}
    return out


def _permission(rule: Rule, source: dict[str, Any]) -> dict[str, Any]:
    proto, lo, hi, field, _ = rule
    return {"IpProtocol": proto, field: [source], **({} if lo is None else {"FromPort": lo, "ToPort": hi})}


def _describe(rule: Rule) -> str:
    proto, lo, hi, _, source = rule
    ports = "" if lo is None else f" {lo}" if lo == hi else f" {lo}-{hi}"
    return f"{'all' if proto == '-1' else proto}{ports} from {source}"


def _set_ingress(ec2: Any, group_id: str, have: list[dict[str, Any]], cidr: str) -> list[str]:
    """Revoke every ingress rule but the asked ones, then add those missing; the rules revoked."""

    field = "Ipv6Ranges" if ":" in cidr else "IpRanges"
    want = {("tcp", 22, 22, field, cidr): {_SOURCE_KEY[field]: cidr, "Description": "gpuctl SSH"},
            ("-1", None, None, "UserIdGroupPairs", group_id): {"GroupId": group_id, "Description": "cluster nodes"}}
    current = _rules(have)
    extra = sorted(set(current) - set(want), key=str)
    missing = sorted(set(want) - set(current), key=str)
    if extra:  # first: the asked source is never added while another is still open
        call(ec2.revoke_security_group_ingress, GroupId=group_id,
             IpPermissions=[_permission(r, current[r]) for r in extra])
    if missing:
        try:
            ec2.authorize_security_group_ingress(GroupId=group_id,
                                                 IpPermissions=[_permission(r, want[r]) for r in missing])
        except aws_errors() as exc:
            if error_code(exc) != "InvalidPermission.Duplicate":  # a concurrent `up` added it
                raise translate(exc, "AuthorizeSecurityGroupIngress") from exc
    return [_describe(r) for r in extra]
