"""The checkpoint store's pure parts: names (long clusters, every region), the policy documents, the
treatment of untrusted keys, and the payload's push/pull logic against an in-memory bucket and
through the AWS CLI (a stand-in `aws` that records its arguments: the test hosts have no AWS CLI);
the payload against the moto server from a real sshd host is in integration/test_aws_store.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuctl.errors import ConfigError
from gpuctl.payloads import gpuctl_store as payload
from gpuctl.provision.aws import store, store_iam

OWNER = "alice@laptop-1a2b3c"
LONG = "a" * 40  # the longest cluster name settings allow
REGIONS = ["us-east-1", "eu-central-1", "ap-southeast-2", "us-gov-west-1", "ap-northeast-3", "me-central-1"]


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("cluster", ["default", LONG, "My_Cluster-2"])
def test_names_are_valid_short_and_distinct(cluster, region):
    bucket = store.bucket_name("123456789012", region, OWNER)
    assert len(bucket) <= 63 and bucket == bucket.lower() and bucket.startswith("gpuctl-123456789012-" + region)
    name = store_iam.profile_name(OWNER, cluster, region)
    assert len(name) <= 64 and name.startswith("gpuctl-")
    assert all(c.isalnum() or c in "+=,.@-_" for c in name)  # IAM's name characters
    # Another owner, cluster or region is another name, even where the cluster had to be shortened;
    # IAM names ignore case, so the hash tells "My" from "my".
    assert store_iam.profile_name("bob@x-000000", cluster, region) != name
    assert store_iam.profile_name(OWNER, cluster + "x" if len(cluster) < 40 else cluster[:-1], region) != name
    assert store_iam.profile_name(OWNER, cluster.swapcase(), region).lower() != name.lower() or cluster.swapcase() == cluster
    assert store.bucket_name("123456789012", region, "bob@x-000000") != bucket


def test_the_role_may_reach_its_own_prefix_only():
    doc = store_iam.access_policy("gpuctl-1-us-east-1-ab", "box")
    objects, listing = doc["Statement"]
    assert objects["Effect"] == listing["Effect"] == "Allow"
    assert sorted(objects["Action"]) == ["s3:DeleteObject", "s3:GetObject", "s3:PutObject"]
    assert objects["Resource"] == "arn:aws:s3:::gpuctl-1-us-east-1-ab/clusters/box/*"
    assert listing["Action"] == "s3:ListBucket" and listing["Resource"] == "arn:aws:s3:::gpuctl-1-us-east-1-ab"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["clusters/box/*"]}}
    assert store_iam.trust_policy()["Statement"] == [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                                      "Action": "sts:AssumeRole"}]
    assert "aws-cn" in json.dumps(store_iam.access_policy("b", "box", "aws-cn"))


def test_the_bucket_refuses_plain_http_and_expires_as_set():
    (deny,) = store.tls_only_policy("b")["Statement"]
    assert deny["Effect"] == "Deny" and deny["Principal"] == "*" and deny["Action"] == "s3:*"
    assert deny["Resource"] == ["arn:aws:s3:::b", "arn:aws:s3:::b/*"]
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    rules = {r["ID"]: r for r in store.lifecycle_rules(7)}
    assert rules["gpuctl-checkpoint-expiry"]["Expiration"] == {"Days": 7}
    assert [r["ID"] for r in store.lifecycle_rules(0)] == ["gpuctl-abort-incomplete-uploads"]
    with pytest.raises(ConfigError, match="checkpoint_expiry_days is -1"):
        store.lifecycle_rules(-1)


@pytest.mark.parametrize("key, rel", [
    ("clusters/c/runs/r/ckpt/model.weights.h5", "ckpt/model.weights.h5"),
    ("clusters/c/runs/r/epochs.jsonl", "epochs.jsonl"),
    ("clusters/c/runs/r/../x", None), ("clusters/c/runs/r/a/../../x", None), ("clusters/c/runs/r//etc/passwd", None),
    ("clusters/c/runs/r/./x", None), ("clusters/c/runs/r/", None), ("clusters/c/runs/r/a//b", None),
    ("clusters/c/runs/r/a\\..\\b", None), ("clusters/c/runs/r/a\nb", None), ("clusters/c/runs/r2/x", None),
    ("clusters/other/runs/r/x", None), ("x", None),
])
def test_untrusted_keys(key, rel):
    assert store.safe_relative(key, "clusters/c/runs/r/") == rel
    assert payload.safe_relative(key, "clusters/c/runs/r/") == rel  # the payload's own copy agrees


@pytest.mark.parametrize("cluster, run_id", [("../x", "r"), ("c/d", "r"), ("c", "../r"), ("c", "a/b"), ("c", ""),
                                             ("c", ".."), ("", "r")])
def test_store_prefixes_refuse_odd_names(cluster, run_id):
    with pytest.raises(ConfigError):
        store.run_prefix(cluster, run_id)


def test_the_payload_and_gpuctl_agree_on_a_runs_prefix():
    from gpuctl.model.images import StoreTarget

    target = StoreTarget(bucket="b", prefix="clusters/c/", region="us-east-1")
    assert payload.run_prefix(target.model_dump(), "r1") == target.run_prefix("r1") == store.run_prefix("c", "r1")


def test_the_payload_imports_without_boto3():
    code = "import sys; sys.modules['boto3'] = None; import gpuctl_store; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(payload.__file__).parent, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# --- push and pull, against an in-memory bucket ---------------------------------------------------


class MemoryBucket:
    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []

    def list(self, prefix):
        import hashlib

        return {k: (len(v), '"%s"' % hashlib.md5(v).hexdigest()) for k, v in self.objects.items() if k.startswith(prefix)}

    def upload(self, path, key):
        self.calls.append(("upload", key))
        self.objects[key] = Path(path).read_bytes()

    def download(self, key, path):
        self.calls.append(("download", key))
        Path(path).write_bytes(self.objects[key])


TARGET = {"kind": "s3", "bucket": "b", "prefix": "clusters/c/", "region": "us-east-1"}
PREFIX = "clusters/c/runs/r1/"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_push_uploads_only_what_changed_and_pull_restores(tmp_path):
    bucket = MemoryBucket()
    run = tree(tmp_path / "run", {"ckpt/1.weights.h5": "w1", "epochs.jsonl": "{}\n", "log.txt": "hi"})
    (run / "outside").symlink_to("/etc/hostname")  # a link is never followed out of the directory
    first = payload.push(str(run), TARGET, PREFIX, store=bucket)
    assert first["uploaded"] == 3 and first["unchanged"] == 0
    assert sorted(bucket.objects) == [PREFIX + "ckpt/1.weights.h5", PREFIX + "epochs.jsonl", PREFIX + "log.txt"]
    again = payload.push(str(run), TARGET, PREFIX, store=bucket)
    assert again["uploaded"] == 0 and again["unchanged"] == 3
    (run / "ckpt/2.weights.h5").write_text("w2")
    with open(run / "epochs.jsonl", "a") as fh:
        fh.write("{}\n")
    third = payload.push(str(run), TARGET, PREFIX, store=bucket)
    assert third["uploaded"] == 2 and third["unchanged"] == 2
    # An object changed behind its back (another instance of the run) is sent again.
    bucket.objects[PREFIX + "log.txt"] = b"other"
    assert payload.push(str(run), TARGET, PREFIX, store=bucket)["uploaded"] == 1

    fresh = tmp_path / "fresh"  # a new instance: nothing there yet
    got = payload.pull(TARGET, PREFIX, str(fresh), store=bucket)
    assert got["downloaded"] == 4 and got["refused"] == [] and got["failed"] == []
    assert (fresh / "ckpt/2.weights.h5").read_text() == "w2" and (fresh / "log.txt").read_text() == "hi"
    assert payload.pull(TARGET, PREFIX, str(fresh), store=bucket)["downloaded"] == 0
    assert payload.push(str(fresh), TARGET, PREFIX, store=bucket)["uploaded"] == 0  # nothing re-sent after a pull


def test_pull_refuses_keys_that_leave_the_directory(tmp_path):
    bucket = MemoryBucket()
    victim = tmp_path / "victim"
    bucket.objects = {PREFIX + "../x": b"evil", PREFIX + "a/../../x": b"evil", PREFIX + "/abs": b"evil",
                      PREFIX + "ok.txt": b"fine", PREFIX + "link/y": b"evil", PREFIX + payload.MANIFEST: b"{}"}
    run = tmp_path / "run"
    run.mkdir()
    (run / "link").symlink_to(tmp_path)  # a link planted in the directory leads nowhere either
    got = payload.pull(TARGET, PREFIX, str(run), store=bucket)
    assert sorted(got["refused"]) == sorted([PREFIX + "../x", PREFIX + "a/../../x", PREFIX + "/abs",
                                             PREFIX + payload.MANIFEST])
    assert got["downloaded"] == 1 and (run / "ok.txt").read_text() == "fine"
    assert [f.split(":")[0] for f in got["failed"]] == ["link/y"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not victim.exists()


@pytest.mark.parametrize("target, prefix, needle", [
    ({**TARGET, "bucket": ""}, PREFIX, "no bucket"),
    ({**TARGET, "kind": "gcs"}, PREFIX, "no S3 store target"),
    (TARGET, "clusters/other/runs/r1/", "not a place under"),
    (TARGET, "clusters/c/runs/../x/", "not a place under"),
    (TARGET, "clusters/c/runs/r1", "not a place under"),
])
def test_bad_targets_are_refused(tmp_path, target, prefix, needle):
    with pytest.raises(payload.StoreError, match=needle):
        payload.push(str(tmp_path), target, prefix, store=MemoryBucket())


def test_cli_prints_one_line_of_json(tmp_path, monkeypatch, capsys):
    bucket = MemoryBucket()
    monkeypatch.setattr(payload, "client", lambda target: bucket)
    run = tree(tmp_path / "run", {"a": "1"})
    target_file = tmp_path / "target.json"
    target_file.write_text(json.dumps(TARGET))
    assert payload.main(["push", str(run), str(target_file), PREFIX]) == 0
    assert json.loads(capsys.readouterr().out)["uploaded"] == 1
    assert payload.main(["pull", str(tmp_path / "back"), json.dumps(TARGET), PREFIX]) == 0
    assert json.loads(capsys.readouterr().out)["downloaded"] == 1
    assert payload.main(["push", str(run), "{not json", PREFIX]) == 1
    assert "error" in json.loads(capsys.readouterr().out)
    assert payload.main(["pull", str(run), json.dumps(TARGET), PREFIX, "--delete"]) == 2


FAKE_AWS = textwrap.dedent('''\
    #!{python}
    """A stand-in for the AWS CLI v2: records its argv, keeps the bucket in a directory."""
    import json, os, shutil, sys, zlib
    root = os.environ["FAKE_BUCKET"]
    with open(os.path.join(root, "..", "calls.jsonl"), "a") as fh:
        fh.write(json.dumps(sys.argv[1:]) + "\\n")
    args = sys.argv[1:]
    while args[0].startswith("--"):
        args = args[2:] if args[0] in ("--region", "--endpoint-url") else args[1:]
    if args[:2] == ["s3api", "list-objects-v2"]:
        prefix = args[args.index("--prefix") + 1]
        contents = []
        for top, _, files in os.walk(root):
            for name in files:
                key = os.path.relpath(os.path.join(top, name), root)
                if key.startswith(prefix):
                    data = open(os.path.join(top, name), "rb").read()
                    contents.append({{"Key": key, "Size": len(data), "ETag": '"%d-%08x"' % (len(data), zlib.crc32(data))}})
        print(json.dumps({{"Contents": contents}} if contents else {{}}))
    elif args[:2] == ["s3", "cp"]:
        src, dst = args[-2:]
        if src.startswith("s3://"):
            src = os.path.join(root, src.split("/", 3)[3])
        else:
            dst = os.path.join(root, dst.split("/", 3)[3])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
    else:
        sys.exit("unexpected: %r" % (args,))
''')


def test_without_boto3_the_aws_cli_does_it(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(FAKE_AWS.format(python=sys.executable))
    (bin_dir / "aws").chmod(0o755)
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    run = tree(tmp_path / "run", {"ckpt/1": "w1", "epochs.jsonl": "{}"})
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_BUCKET=str(bucket))
    target = json.dumps({**TARGET, "endpoint": "http://10.251.1.1:5000"})
    script = Path(payload.__file__)
    hide_boto3 = ["-c", "import sys, runpy; sys.modules['boto3'] = None; sys.argv = sys.argv[1:]; "
                        "runpy.run_path(sys.argv[0], run_name='__main__')", str(script)]

    def run_payload(*args):
        out = subprocess.run([sys.executable, *hide_boto3, *args], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr + out.stdout
        return json.loads(out.stdout)

    assert run_payload("push", str(run), target, PREFIX)["uploaded"] == 2
    assert (bucket / PREFIX / "ckpt/1").read_text() == "w1"
    assert run_payload("push", str(run), target, PREFIX)["uploaded"] == 0
    assert run_payload("pull", str(tmp_path / "back"), target, PREFIX)["downloaded"] == 2
    assert (tmp_path / "back/ckpt/1").read_text() == "w1"
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert all(c[:5] == ["--region", "us-east-1", "--no-cli-pager", "--endpoint-url", "http://10.251.1.1:5000"]
               for c in calls)
    assert any(c[5:7] == ["s3", "cp"] and c[-1] == f"s3://b/{PREFIX}ckpt/1" for c in calls)


# --- launch: the profile, and IAM's delay -------------------------------------------------------------


def test_run_instances_waits_while_ec2_does_not_see_the_new_profile_yet(monkeypatch):
    from types import SimpleNamespace

    import boto3
    from botocore.stub import Stubber

    from gpuctl.provision.aws import launch, nodes

    from tests.waits import FakeClock

    monkeypatch.setattr(launch, "PROFILE_RETRIES", 2)
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    clock = FakeClock()
    aws = SimpleNamespace(ec2=lambda region=None: ec2, region="us-east-1", clock=clock)
    plan = launch.LaunchPlan(cluster="c", owner="o", instance_type="g5.xlarge", image_id="ami-1", root_device="/dev/sda1",
                             key_name="k", security_group="sg-1", subnets={"us-east-1a": "subnet-1"}, market="spot",
                             max_price=0.0, fallback_on_demand=False, disk_gb=100, user_data="", token_seed="t",
                             instance_profile="gpuctl-c-us-east-1-0123456789")
    assert launch.run_params(plan, "us-east-1a", "spot")["IamInstanceProfile"] == {"Name": plan.instance_profile}
    seen = []
    with Stubber(ec2) as stub:
        for _ in range(2):
            stub.add_client_error("run_instances", "InvalidParameterValue",
                                  "Value (gpuctl-c-us-east-1-0123456789) for parameter iamInstanceProfile.name is "
                                  "invalid. Invalid IAM Instance Profile name")
        stub.add_response("run_instances", {"Instances": [{"InstanceId": "i-1"}]})
        (inst,), market = nodes.launch_nodes(aws, plan, seen.append)
    assert inst["InstanceId"] == "i-1" and market == "spot"
    assert sum("does not see instance profile" in line for line in seen) == 2
    assert clock.slept == [1.0, 2.0] and seen[-1].endswith("again in 2s")
    with Stubber(ec2) as stub:  # for good: the third refusal stops the launch
        for _ in range(3):
            stub.add_client_error("run_instances", "InvalidParameterValue", "Invalid IAM Instance Profile name")
        with pytest.raises(Exception, match="InvalidParameterValue"):
            nodes.launch_nodes(aws, plan, seen.append)


def test_a_restore_waits_for_a_store_it_cannot_reach_yet(tmp_path, monkeypatch):
    """A replacement instance whose role credentials were not served yet (NoCredentialsError at
    its first list) gave up at once and the run failed; the pull is tried again, then it stands."""
    bucket = MemoryBucket()
    tries, said = [], []

    class NotYet(Exception):
        pass

    def client(target):
        tries.append(1)
        if len(tries) < 3:
            raise NotYet("Unable to locate credentials")
        return bucket

    monkeypatch.setattr(payload, "client", client)
    monkeypatch.setattr(payload.time, "sleep", lambda s: None)
    got = payload.pull_when_reachable(TARGET, PREFIX, str(tmp_path / "run"), said.append)
    assert got["downloaded"] == 0 and len(tries) == 3
    assert said[0] == "the store did not answer (NotYet: Unable to locate credentials): trying again in 2 s"
    tries.clear()
    monkeypatch.setattr(payload, "client", lambda target: (_ for _ in ()).throw(NotYet("still not")))
    with pytest.raises(NotYet):  # after the last wait, the error is the caller's to say
        payload.pull_when_reachable(TARGET, PREFIX, str(tmp_path / "run"), waits=(1,))


def test_a_push_leaves_out_the_top_level_directories_it_is_told_to(tmp_path):
    bucket = MemoryBucket()
    run = tree(tmp_path / "run", {"data/train.csv": "a data set", "outputs/data/kept.txt": "an output named data",
                                  "code/train.py": "x", "epochs.jsonl": "{}\n"})
    assert payload.push(str(run), TARGET, PREFIX, store=bucket, leave_out=("data",))["uploaded"] == 3
    assert sorted(bucket.objects) == [PREFIX + "code/train.py", PREFIX + "epochs.jsonl",
                                      PREFIX + "outputs/data/kept.txt"]


def test_a_runs_save_leaves_its_data_copy_on_the_instance(tmp_path, monkeypatch):
    """The run's copy of its data set (RUN/data, linked at submission) is never sent to the store
    at each epoch's save: it can be many GB, and it came from this machine or a bucket."""
    import functools
    import types

    monkeypatch.syspath_prepend(str(Path(payload.__file__).parent))  # the payloads' bare-name imports
    import gpuctl_run  # type: ignore[import-not-found]

    bucket = MemoryBucket()
    run = tree(tmp_path / "run", {"data/train.csv": "a data set", "outputs/model.txt": "weights",
                                  "code/train.py": "x", "epochs.jsonl": "{}\n"})
    saver = gpuctl_run.RunStore()
    saver.target, saver.prefix, saver.run_dir = TARGET, PREFIX, str(run)
    saver.store = types.SimpleNamespace(push=functools.partial(payload.push, store=bucket))  # the real push, in memory
    saver.save("epoch 1")
    assert sorted(bucket.objects) == [PREFIX + "code/train.py", PREFIX + "epochs.jsonl", PREFIX + "outputs/model.txt"]
