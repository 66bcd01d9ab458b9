"""Faults on the aws path (moto server over HTTP): a type with no GPU says so;
a cluster whose instances ended without `down` (a guard's poweroff, an interrupted `down`) leaves
nothing a plain `down` does not release; a ledger that cannot be read still lets `status --all`
and `down --all` find and release what runs, by its tags.

Bad inputs tried: `--type t2.micro` (no GPU), a ledger overwritten with garbage."""

from __future__ import annotations

import json

from tests.aws import gpuctl_groups, gpuctl_keys, live_instances, nothing_created

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
