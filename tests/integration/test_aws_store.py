"""The checkpoint store on AWS: the bucket, the cluster's instance profile, and the payload that
pushes and pulls a run's files from a real sshd test host, all against the moto server over HTTP
(see tests/aws.py; the hosts reach it through their gateway, GPUCTL_TEST_S3_ENDPOINT).

Bad inputs tried: IAM refusing CreateRole (a clear error, nothing left behind), a bucket name
another account holds, `aws.checkpoints = "bogus"`, `aws.checkpoint_expiry_days = -1`, a hostile
key ("../x") in the bucket on pull, `runs rm` of an unknown run and of a running one."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from gpuctl.provision.aws import store_iam
from gpuctl.provision.aws.store import bucket_name
from tests.aws import ACCOUNT, REGION, live_instances, moto_client, nothing_created, s3_endpoint
from tests.conftest import HOST_PYTHON

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]
PAYLOAD = Path(__file__).resolve().parents[2] / "gpuctl" / "payloads" / "gpuctl_store.py"


def tag_dict(tags):
    return {t["Key"]: t["Value"] for t in tags}


def owner_of(home: Path) -> str:
    return (home / "owner").read_text().strip()


def clients():
    return moto_client("s3"), moto_client("iam")


def store_place(home: Path, name: str = "default") -> str:
    from gpuctl.ledger import Ledger

    led = Ledger(home)
    try:
        return led.live_cluster(name).spec.store_place
    finally:
        led.close()


def gpuctl_roles(iam):
    return iam.list_roles(PathPrefix=store_iam.PATH)["Roles"]


def gpuctl_profiles(iam):
    return iam.list_instance_profiles(PathPrefix=store_iam.PATH)["InstanceProfiles"]


def test_up_makes_a_private_bucket_and_a_profile_for_the_clusters_prefix_only(gpuctl, aws, isolated):
    # The administrator's permissions boundary (docs/aws-iam.md; the aws fixture makes it): every
    # gpuctl role gets it.
    boundary = f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}"
    res = gpuctl(*UP)
    owner = owner_of(isolated)
    bucket = bucket_name(ACCOUNT, REGION, owner)
    place = store_place(isolated)
    assert place.startswith("default.") and f"checkpoints: s3://{bucket}/clusters/{place}/" in res.stderr
    s3, iam = clients()

    assert s3.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert block == {"BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                     "RestrictPublicBuckets": True}
    tags = tag_dict(s3.get_bucket_tagging(Bucket=bucket)["TagSet"])
    assert tags["gpuctl:created-by"] == "gpuctl" and tags["gpuctl:owner"] == owner
    lifecycle = {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert lifecycle["gpuctl-checkpoint-expiry"]["Expiration"] == {"Days": 30}
    assert lifecycle["gpuctl-checkpoint-expiry"]["Filter"] == {"Prefix": "clusters/"}
    assert lifecycle["gpuctl-abort-incomplete-uploads"]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    assert policy["Statement"][0]["Effect"] == "Deny"
    assert policy["Statement"][0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}

    name = store_iam.profile_name(owner, "default", REGION)
    (role,) = gpuctl_roles(iam)
    assert role["RoleName"] == name and role["Path"] == store_iam.owner_path(owner)
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert iam.get_role(RoleName=name)["Role"]["PermissionsBoundary"]["PermissionsBoundaryArn"] == boundary
    role_tags = tag_dict(iam.list_role_tags(RoleName=name)["Tags"])
    assert role_tags["gpuctl:cluster"] == "default" and role_tags["gpuctl:owner"] == owner
    assert role_tags["gpuctl:region"] == REGION
    assert iam.list_role_policies(RoleName=name)["PolicyNames"] == [store_iam.POLICY_NAME]
    doc = iam.get_role_policy(RoleName=name, PolicyName=store_iam.POLICY_NAME)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == store_iam.access_policy(bucket, place)
    assert doc["Statement"][0]["Resource"] == f"arn:aws:s3:::{bucket}/clusters/{place}/*"
    (profile,) = gpuctl_profiles(iam)
    assert profile["InstanceProfileName"] == name and [r["RoleName"] for r in profile["Roles"]] == [name]
    assert tag_dict(iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Tags"])["gpuctl:owner"] == owner

    (inst,) = live_instances(aws)
    assert inst["IamInstanceProfile"]["Arn"].endswith(f"instance-profile{store_iam.owner_path(owner)}{name}")
    # IMDS answers the instance's own processes only (a container gets nothing of its role).
    assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    # Versions: an instance that overwrites or deletes its checkpoints leaves the earlier ones for 3 days.
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    assert lifecycle["gpuctl-earlier-versions"]["NoncurrentVersionExpiration"] == {"NoncurrentDays": 3}

    # The profile is the cluster's: status --all lists it, down removes it; the bucket stays.
    listed = json.loads(gpuctl("status", "--all", "--json").stdout)
    assert any(r["kind"] == "instance-profile" and r["id"] == name for r in listed["resources"])
    s3.put_object(Bucket=bucket, Key="clusters/default/runs/r1/ckpt", Body=b"weights")
    res = gpuctl("down", "-y")
    assert f"deleted instance profile and role {name}" in res.stderr
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == []
    assert s3.get_object(Bucket=bucket, Key="clusters/default/runs/r1/ckpt")["Body"].read() == b"weights"
    nothing_created(aws)
    gpuctl("down", "-y")  # again: nothing left, nothing fails


def test_checkpoints_on_the_instance_make_no_bucket_and_no_role(gpuctl, aws, monkeypatch):
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", "instance")
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_EXPIRY_DAYS", "0")
    gpuctl(*UP)
    s3, iam = clients()
    assert s3.list_buckets()["Buckets"] == []
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == []
    (inst,) = live_instances(aws)
    assert "IamInstanceProfile" not in inst
    gpuctl("down", "-y")


def test_expiry_zero_keeps_checkpoints_until_runs_rm(gpuctl, aws, isolated, monkeypatch):
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_EXPIRY_DAYS", "0")
    res = gpuctl(*UP)
    assert "kept until `gpuctl runs rm`" in res.stderr
    s3, _ = clients()
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket_name(ACCOUNT, REGION, owner_of(isolated)))["Rules"]
    # No expiry of the checkpoints themselves; earlier versions (aws.checkpoint_versions_days)
    # still expire, so a checkpoint overwritten every epoch does not pile up for ever.
    assert [r["ID"] for r in rules] == ["gpuctl-abort-incomplete-uploads", "gpuctl-earlier-versions",
                                        "gpuctl-lone-delete-markers"]
    gpuctl("down", "-y")


@pytest.mark.parametrize("key, value, needle", [
    ("CHECKPOINTS", "bogus", "aws.checkpoints"),
    ("CHECKPOINT_EXPIRY_DAYS", "-1", "aws.checkpoint_expiry_days"),
])
def test_bad_checkpoint_settings_are_refused_before_anything_exists(gpuctl, aws, monkeypatch, key, value, needle):
    monkeypatch.setenv(f"GPUCTL_AWS__{key}", value)
    res = gpuctl(*UP, code=3)
    assert needle in res.stderr and "Traceback" not in res.stderr
    nothing_created(aws)
    assert clients()[0].list_buckets()["Buckets"] == []


def test_iam_refused_says_so_and_leaves_nothing(gpuctl, aws, monkeypatch):
    # moto's IAM enforcement checks every call of the test's own credentials as well (the reset,
    # the checks below) and knows no Resource or Condition; refusing CreateRole alone, as an
    # account without IAM permissions does, is done in the backend the server serves from.
    from moto.iam.exceptions import IAMException
    from moto.iam.models import IAMBackend

    class AccessDenied(IAMException):
        code = "AccessDenied"

        def __init__(self):
            super().__init__("User: arn:aws:iam::123456789012:user/dev is not authorized to perform: iam:CreateRole "
                             "on resource: arn:aws:iam::123456789012:role/gpuctl/x")

    def refuse(self, *args, **kwargs):
        raise AccessDenied()

    monkeypatch.setattr(IAMBackend, "create_role", refuse)
    res = gpuctl(*UP, code=9)
    err = res.stderr
    assert "Error: not allowed to call iam:CreateRole, needed for the checkpoint role of cluster 'default'" in err
    assert 'aws.checkpoints = "instance"' in err and "docs/aws-iam.md" in err
    nothing_created(aws)
    s3, iam = clients()
    assert gpuctl_roles(iam) == [] and gpuctl_profiles(iam) == [] and s3.list_buckets()["Buckets"] == []
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_up_without_the_permissions_boundary_is_refused_and_creates_nothing(gpuctl, aws, monkeypatch):
    """Without the boundary policy, `up` made the cluster's role with
    `PermissionsBoundary: None` and said nothing (the README says it fails first)."""
    _, iam = clients()
    iam.delete_policy(PolicyArn=f"arn:aws:iam::{ACCOUNT}:policy/{store_iam.BOUNDARY}")
    res = gpuctl(*UP, code=9)
    assert f"the permissions boundary {store_iam.BOUNDARY} does not exist in account {ACCOUNT}" in res.stderr
    assert 'aws.checkpoints = "instance"' in res.stderr and "docs/aws-iam.md" in res.stderr
    assert "Traceback" not in res.stderr
    nothing_created(aws)
    assert gpuctl_roles(iam) == [] and clients()[0].list_buckets()["Buckets"] == []
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    # Checkpoints on the instance need no role: `up` goes ahead.
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", "instance")
    gpuctl(*UP)
    assert len(live_instances(aws)) == 1 and gpuctl_roles(iam) == []
    gpuctl("down", "-y")


def test_a_later_cluster_of_the_same_name_cannot_reach_the_earlier_ones_checkpoints(gpuctl, aws, isolated,
                                                                                   monkeypatch):
    """The prefix was the cluster's name, so a later cluster of the same name read
    and deleted the earlier one's checkpoints (kept 30 days)."""
    _, iam = clients()
    places = []
    for _ in range(2):
        gpuctl(*UP)
        name = store_iam.profile_name(owner_of(isolated), "default", REGION)
        places.append(store_place(isolated))
        doc = iam.get_role_policy(RoleName=name, PolicyName=store_iam.POLICY_NAME)["PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        resources = json.dumps(doc)
        assert f"clusters/{places[-1]}/" in resources
        assert all(f"clusters/{p}/" not in resources for p in places[:-1]), resources  # not the earlier one's
        gpuctl("down", "-y")
    assert places[0] != places[1] and all(p.startswith("default.") for p in places)
    # Containers get the metadata service (and the role) only when asked for.
    monkeypatch.setenv("GPUCTL_AWS__IMDS_FOR_CONTAINERS", "true")
    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 2
    gpuctl("down", "-y")


def test_versions_off_suspends_versioning(gpuctl, aws, isolated, monkeypatch):
    gpuctl(*UP)
    gpuctl("down", "-y")
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_VERSIONS_DAYS", "0")
    gpuctl(*UP)
    s3, _ = clients()
    bucket = bucket_name(ACCOUNT, REGION, owner_of(isolated))
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Suspended"
    rules = [r["ID"] for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]]
    assert "gpuctl-earlier-versions" not in rules
    gpuctl("down", "-y")


# --- the payload on a real host, against the moto server, with instance-profile credentials -----------


def on_host(ssh, host, known: Path, command: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """A command over real SSH on a test host (plain OpenSSH, no terminal)."""
    argv = [a for a in host.ssh_argv(ssh.key, known) if a != "-tt"] + ["-T", command]
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=120)


def test_the_payload_pushes_and_pulls_on_a_host_with_the_instance_profile(gpuctl, aws, ssh, imds, moto_server,
                                                                          isolated, tmp_path, monkeypatch):
    from gpuctl.ops.session import Session

    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", s3_endpoint(moto_server, host))
    gpuctl(*UP)  # makes the bucket and the cluster's instance profile
    owner = owner_of(isolated)
    bucket = bucket_name(ACCOUNT, REGION, owner)
    session = Session(isolated)
    cluster = session.ledger.live_cluster("default")
    place = cluster.spec.store_place
    target = session.provider(cluster.spec).checkpoint_store().target(place)  # what a run's config is given
    session.close()
    assert (target.bucket, target.prefix, target.endpoint) == (bucket, f"clusters/{place}/", s3_endpoint(moto_server, host))
    prefix = target.run_prefix("proj-20261130-101500-ab12")
    imds.role(store_iam.profile_name(owner, "default", REGION))  # what EC2 serves an instance with that profile

    known = tmp_path / "known_hosts"
    known.write_text(f"{host.ip} {host.pubkey}\n")
    host.run("mkdir -p /srv/run/ckpt && printf w1 > /srv/run/ckpt/1.weights.h5 && printf '{}\\n' > /srv/run/epochs.jsonl")
    # Only what boto3 finds by itself: no key in the environment, no config file, the metadata service.
    env = (f"env -i PATH=/usr/bin:/bin HOME=/srv AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null "
           f"AWS_EC2_METADATA_SERVICE_ENDPOINT={imds.url(host)}")
    python = HOST_PYTHON
    target_json = shlex.quote(target.model_dump_json())

    def store(*steps: tuple[str, str], stdin: bytes | None = None) -> list[dict]:
        """The payload's steps in one SSH session (a login is slow where the shell's rc files are)."""
        commands = ["mkdir -p /srv/payload && cat > /srv/payload/gpuctl_store.py"] if stdin else []
        commands += [f"{env} {python} /srv/payload/gpuctl_store.py {op} {directory} {target_json} {prefix}"
                     for op, directory in steps]
        res = on_host(ssh, host, known, " && ".join(commands), stdin)
        assert res.returncode == 0, res.stderr.decode() + res.stdout.decode()
        return [json.loads(line) for line in res.stdout.decode().strip().splitlines()[-len(steps):]]

    # The payload goes over as gpuctl sends payloads: into the host's own directory.
    first, second = store(("push", "/srv/run"), ("push", "/srv/run"), stdin=PAYLOAD.read_bytes())
    assert first["uploaded"] == 2 and first["where"] == f"s3://{bucket}/{prefix}"
    assert second == {**first, "uploaded": 0, "unchanged": 2, "bytes": 0}  # nothing unchanged is sent again
    s3, _ = clients()
    keys = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]}
    assert keys == {prefix + "ckpt/1.weights.h5": 2, prefix + "epochs.jsonl": 3}
    role = store_iam.profile_name(owner, "default", REGION)
    assert any(imds.gets(f"/latest/meta-data/iam/security-credentials/{role}"))  # the profile's credentials

    host.run("printf w2 > /srv/run/ckpt/2.weights.h5")
    s3.put_object(Bucket=bucket, Key=prefix + "../escaped", Body=b"evil")  # planted by whoever could write there
    third, back = store(("push", "/srv/run"), ("pull", "/srv/back"))
    assert third["uploaded"] == 1 and third["unchanged"] == 2
    assert back["downloaded"] == 3 and back["failed"] == [] and back["refused"] == [prefix + "../escaped"]
    assert host.run("cat /srv/back/ckpt/1.weights.h5 /srv/back/ckpt/2.weights.h5").stdout == "w1w2"
    # Nothing escaped (the lab's own gpuctl work dir aside: it keeps the preflight's answer there).
    assert [d for d in host.run("ls /srv").stdout.split() if d != "gpuctl"] == ["back", "payload", "run"]
    gpuctl("down", "-y")


# --- cost and runs rm ------------------------------------------------------------------------------


def add_run(home: Path, run_id: str, state: str) -> None:
    import time

    from gpuctl.ledger import Ledger
    from gpuctl.model.records import RunRecord

    led = Ledger(home)
    cluster = led.live_cluster("default")
    led.put_run(RunRecord(run_id=run_id, cluster="default", cluster_id=cluster.id, project="/p", entry="train.py",
                          state=state, started_at=time.time() - 60, ended_at=None if state == "running" else time.time(),
                          run_dir=f"~/gpuctl/runs/{run_id}"))
    led.close()


def test_cost_shows_the_buckets_storage_and_runs_rm_deletes_a_runs_checkpoints(gpuctl, aws, isolated, monkeypatch):
    gpuctl(*UP)
    bucket = bucket_name(ACCOUNT, REGION, owner_of(isolated))
    s3, _ = clients()
    mib = b"x" * (1 << 20)
    for key, body in {"clusters/default/runs/r1-20261130-000000-aaaa/ckpt/1.h5": mib * 3,
                      "clusters/default/runs/r1-20261130-000000-aaaa/epochs.jsonl": b"{}\n",
                      "clusters/second/runs/r1-20261130-000000-aaaa/ckpt/1.h5": mib,  # a copy (resumed elsewhere)
                      "clusters/default/runs/r2-20261130-000000-bbbb/ckpt/1.h5": mib,
                      "clusters/default/runs/r1-20261130-000000-aaaa/../odd": b"?",  # never counted
                      "elsewhere/x": mib}.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    add_run(isolated, "r1-20261130-000000-aaaa", "succeeded")
    add_run(isolated, "r2-20261130-000000-bbbb", "running")

    report = json.loads(gpuctl("cost", "--json").stdout)["checkpoints"]
    sizes = {(r["cluster"], r["run_id"]): r["bytes"] for r in report["runs"]}
    assert sizes == {("default", "r1-20261130-000000-aaaa"): 3 * (1 << 20) + 3,
                     ("second", "r1-20261130-000000-aaaa"): 1 << 20, ("default", "r2-20261130-000000-bbbb"): 1 << 20}
    assert report["usd_per_month"] == pytest.approx((5 * (1 << 20) + 3) / 2 ** 30 * 0.023)
    assert "S3 Standard list price, us-east-1, 2026-11" in report["price"] and report["note"] is None
    assert "Checkpoints kept: 2 run(s)" in gpuctl("cost").stdout

    # Bad inputs first: an unknown run, a running one, no confirmation.
    assert "no run named 'nope'" in gpuctl("runs", "rm", "nope", "-y", code=4).stderr
    err = gpuctl("runs", "rm", "r2-20261130-000000-bbbb", "-y", code=5).stderr
    assert "is running" in err and "Hint:" in err
    assert "without confirmation" in gpuctl("runs", "rm", "r1-20261130-000000-aaaa", code=2).stderr
    assert len(s3.list_objects_v2(Bucket=bucket)["Contents"]) == 6

    res = json.loads(gpuctl("runs", "rm", "r1-20261130-000000-aaaa", "-y", "--json").stdout)
    assert res["store_files"] == 4  # both clusters' copies, and the odd key under its prefix
    assert "stays" in res["note"]  # moto's instance has no host to reach: its directory goes with it
    left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert left == ["clusters/default/runs/r2-20261130-000000-bbbb/ckpt/1.h5", "elsewhere/x"]
    runs = {r["run_id"] for r in json.loads(gpuctl("cost", "--json").stdout)["runs"]}
    assert "r1-20261130-000000-aaaa" in runs  # the ledger keeps its record and dollars

    gpuctl("down", "--force", "-y")  # r2 "runs" on a host moto cannot give
    # Without credentials `cost` still answers, and says what it left out.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    out = json.loads(gpuctl("cost", "--json").stdout)["checkpoints"]
    assert out["runs"] == [] and "no AWS credentials" in out["note"]


def test_runs_rm_on_a_provider_without_a_store_removes_the_runs_directory(gpuctl, quick_project):
    # local (as ssh): checkpoints stay in the run's directory on the host; no AWS here.
    gpuctl("up")
    run_id = json.loads(gpuctl("train", quick_project, "--wait", "--json").stdout)["run"]["run_id"]
    from gpuctl.ledger import Ledger
    from gpuctl.ledger.schema import gpuctl_home

    run_dir = Path(Ledger(gpuctl_home()).run(run_id).run_dir)
    assert run_dir.is_dir()
    res = gpuctl("runs", "rm", run_id, "-y")
    assert f"deleted {run_dir} on its host" in res.stdout and not run_dir.exists()
    assert run_id in gpuctl("cost").stdout  # its record and dollars stay
    gpuctl("down", "-y")
    res = json.loads(gpuctl("runs", "rm", run_id, "-y", "--json").stdout)
    assert res["store_files"] == 0 and res["host_dir"] is None and "is down" in res["note"]


def test_down_asks_with_the_runs_whose_outputs_exist_only_on_the_instance(gpuctl, aws, isolated, monkeypatch):
    """With aws.checkpoints = "instance" the release deletes the runs' files, and
    the prompt says which (from the ledger: moto's made-up addresses are never dialled)."""
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", "instance")
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINT_EXPIRY_DAYS", "0")
    gpuctl(*UP)
    add_run(isolated, "r1-20261130-000000-aaaa", "succeeded")
    err = gpuctl("down", code=2).stderr
    assert "on the instance's disk only" in err
    assert "1 run(s) have outputs only on the instance (r1-20261130-000000-aaaa)" in err
    assert "`gpuctl down default --pull`" in err
    gpuctl("down", "--force", "-y")  # its host (an address of the tests' seam) does not answer


def test_down_says_the_store_keeps_the_runs_files(gpuctl, aws):
    gpuctl(*UP)
    err = gpuctl("down", code=2).stderr
    assert "stay in the S3 checkpoint store" in err and "only on the instance" not in err
    gpuctl("down", "-y")


def test_pull_after_down_brings_the_runs_files_from_the_store(gpuctl, aws, isolated, tmp_path):
    """The instance's disk went with `down`; each save put the run's files in the store, and pull
    takes them from there. Keys are untrusted: only plain paths under the run's prefix are written."""
    gpuctl(*UP)
    bucket = bucket_name(ACCOUNT, REGION, owner_of(isolated))
    s3, _ = clients()
    run_id = "r1-20261130-000000-aaaa"
    prefix = f"clusters/{store_place(isolated)}/runs/{run_id}/"
    for rel, body in {"outputs/model.txt": b"weights", "outputs/checkpoint/ckpt-1.index": b"i",
                      "epochs.jsonl": b"{}\n", "code/train.py": b"print()", "data/train.csv": b"a data set",
                      "../escaped": b"evil", "outputs/\x1b[31mred": b"?", "outputs//double": b"?"}.items():
        s3.put_object(Bucket=bucket, Key=prefix + rel, Body=body)
    add_run(isolated, run_id, "succeeded")
    gpuctl("down", "-y")
    res = gpuctl("pull", run_id, "--dest", tmp_path / "back", "--json")
    got = json.loads(res.stdout)
    back = tmp_path / "back" / run_id
    assert got["files"] == 4 and (back / "outputs" / "model.txt").read_bytes() == b"weights"
    assert (back / "code" / "train.py").exists() and (back / "epochs.jsonl").exists()
    assert not (back / "data").exists() and not (tmp_path / "back" / "escaped").exists()
    assert len(got["skipped"]) == 3 and all("not a plain path" in why for why in got["skipped"])
    assert sorted(p.name for p in (back / "outputs").iterdir()) == ["checkpoint", "model.txt"]
    again = gpuctl("pull", run_id, "--dest", tmp_path / "back").stdout  # over the first: fine
    assert f"Pulled 4 file(s) of {run_id}" in again and "\x1b" not in again

    # A run whose cluster is down with nothing in the store: said, as before.
    add_run_down = "r2-20261130-000000-bbbb"
    gpuctl(*UP)
    add_run(isolated, add_run_down, "succeeded")
    gpuctl("down", "-y")
    assert "which is down" in gpuctl("pull", add_run_down, "--dest", tmp_path / "b2", code=4).stderr
