"""Faults on the aws path (moto server over HTTP): a type with no GPU says so;
a cluster whose instances ended without `down` (a guard's poweroff, an interrupted `down`) leaves
nothing a plain `down` does not release; a ledger that cannot be read still lets `status --all`
and `down --all` find and release what runs, by its tags.

Bad inputs tried: `--type t2.micro` (no GPU), a ledger overwritten with garbage."""

from __future__ import annotations

import json

import pytest

from gpuctl.cli import cli as gpuctl_cli
from tests.aws import boto3_session, gpuctl_groups, gpuctl_keys, live_instances, nothing_created
from tests.faulty_aws import FaultyAws

UP = ["up", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]


def test_a_type_without_a_gpu_is_named_as_such(gpuctl, aws):
    res = gpuctl(*UP, "--type", "t2.micro")
    assert "warning: t2.micro has no GPU" in res.stderr and "--allow-cpu" in res.stderr
    gpuctl("down", "-y")
    res = gpuctl(*UP, "--type", "g5.xlarge")
    assert "has no GPU" not in res.stderr
    gpuctl("down", "-y")


def test_what_an_ended_cluster_left_is_released_by_a_plain_down(gpuctl, aws):
    gpuctl(*UP, "--type", "g5.xlarge")
    (inst,) = live_instances(aws)
    # It ended without `down` (its guard powered it off; or `down` was interrupted after the
    # instance went): its security group and key pair are still there.
    aws.terminate_instances(InstanceIds=[inst["InstanceId"]])
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"
    assert gpuctl_groups(aws) and gpuctl_keys(aws)
    res = gpuctl("down", "-y")
    assert "deleted security group" in res.stderr
    nothing_created(aws)
    assert "nothing to do" in gpuctl("down", "-y").stdout


def test_a_broken_ledger_still_finds_and_releases_by_tags(gpuctl, aws, isolated):
    gpuctl(*UP, "--type", "g5.xlarge")
    (isolated / "ledger.sqlite3").write_bytes(b"garbage" * 1000)
    for wal in ("ledger.sqlite3-wal", "ledger.sqlite3-shm"):
        (isolated / wal).unlink(missing_ok=True)
    assert gpuctl("status", code=3).exit_code == 3  # the plain one names the file
    res = gpuctl("status", "--all")
    assert "cannot be read" in res.stdout + res.stderr and live_instances(aws)[0]["InstanceId"] in res.stdout
    gpuctl("down", "--all", "-y")
    nothing_created(aws)


@pytest.fixture
def faulty(aws, moto_server, monkeypatch):
    """gpuctl's AWS calls through a proxy that fails the operations a test names; one try each
    (AWS_MAX_ATTEMPTS, boto3's own setting: gpuctl's retries back off for tens of seconds)."""
    proxy = FaultyAws(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    yield proxy
    proxy.close()


def _ec2(region: str):
    return boto3_session().client("ec2", region_name=region)


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_a_cloud_fault_is_a_cloud_error_and_down_all_goes_on_past_it(gpuctl, aws, faulty, kind="html-500"):
    """Each shape of fault is tried by the test below; this one is about going on past it."""
    gpuctl(*UP, "--type", "g5.xlarge", "--name", "east")
    gpuctl(*UP, "--type", "g5.xlarge", "--name", "west", "--region", "eu-west-1")
    west = _ec2("eu-west-1")
    assert live_instances(aws) and live_instances(west)
    fault = faulty.fail("TerminateInstances", region="us-east-1", kind=kind)
    res = gpuctl("down", "--all", "-y", code=9)
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    assert "east" in res.stderr and "TerminateInstances" in res.stderr
    assert fault.seen  # the fault was met, not dodged
    assert live_instances(aws) and not live_instances(west), "the other region was not released"
    # A plain down says the same of its one cluster, with the cloud's exit code.
    res = gpuctl("down", "east", "-y", code=9)
    assert "internal error" not in res.stderr and "TerminateInstances" in res.stderr
    faulty.faults.clear()
    gpuctl("down", "--all", "-y")
    nothing_created(aws)
    nothing_created(west)


@pytest.mark.parametrize("kind", ["html-500", "throttled", "dropped", "garbage-200"])
def test_an_instance_look_that_fails_in_any_shape_is_the_clouds_error_never_internal(gpuctl, aws, faulty, kind):
    gpuctl(*UP, "--type", "g5.xlarge")
    faulty.fail("DescribeInstances", kind=kind)
    for argv in (["status"], ["cost"], ["down", "-y"]):
        res = gpuctl.runner.invoke(gpuctl_cli, argv)
        assert "internal error" not in res.stderr, (argv, res.stderr)
        assert res.exit_code in (0, 9), (argv, res.exit_code, res.stderr)
    assert not live_instances(aws), "down did not end the instance"
    faulty.faults.clear()
    gpuctl("down", "-y")
    nothing_created(aws)


@pytest.mark.parametrize("action, kind", [("DescribeSecurityGroups", "html-500"), ("ListInstanceProfiles", "garbage-200")])
def test_down_ends_the_instances_it_knows_when_the_search_for_the_rest_fails(gpuctl, aws, faulty, action, kind):
    gpuctl(*UP, "--type", "g5.xlarge")
    faulty.fail(action, kind=kind)
    res = gpuctl("down", "-y", code=9)
    assert "ending its 1 instance(s) the ledger knows" in res.stderr and "internal error" not in res.stderr
    assert not live_instances(aws), f"the instance kept billing while {action} failed"
    assert gpuctl_groups(aws), "its group was not found, so not deleted: the next down does it"
    faulty.faults.clear()
    assert "deleted security group" in gpuctl("down", "-y").stderr
    nothing_created(aws)
