"""The AWS path end to end: a moto-launched instance, mapped to a real sshd test host by the
test-only seam GPUCTL_TEST_ENDPOINTS, then up -> train (real TF payload, 2 epochs) -> logs ->
cost -> down."""

import json
import threading

import pytest

from tests.aws import live_instances, nothing_created
from tests.integration.test_ssh import TF_TRAIN
from tests.waits import wait_for


def cloud_init(host, isolated, cluster="default"):
    """As on a real instance, the cluster's key is accepted only some time after boot: `up` must
    keep retrying until it is. `cluster` may be a glob (a bake's name has a random part). Returns
    the thread doing it."""
    authorized = host.base / "authorized_keys"
    lab_key = authorized.read_text()
    keys = isolated / "keys"

    def install():
        try:
            wait_for(lambda: list(keys.glob(f"{cluster}.us-east-1.pub")), 60, "the cluster's key")
        except AssertionError:
            return  # that cluster was never launched (a test that refused it)
        # Not before sshd has refused a login with it (a fixed delay was sometimes too short on a
        # loaded machine: the first login already worked and `up` had nothing to wait for).
        log = host.base / "sshd.log"
        seen = log.stat().st_size if log.exists() else 0

        def refused() -> bool:
            try:
                return b"authenticating user" in log.read_bytes()[seen:]
            except OSError:
                return True  # the lab is gone: its test has ended

        try:
            wait_for(refused, 30, "sshd's refusal of the key")
        except AssertionError:
            pass  # installed all the same
        found = list(keys.glob(f"{cluster}.us-east-1.pub"))
        if len(found) == 1:  # none: that cluster was never launched (a test that refused it)
            authorized.write_text(lab_key + found[0].read_text())

    installer = threading.Thread(target=install, daemon=True)
    installer.start()
    return installer


@pytest.mark.tf  # the one whole loop on aws (moto) with real Keras
def test_aws_up_train_logs_cost_down(gpuctl, aws, ssh, make_project, monkeypatch, isolated):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={host.ip}")
    authorized = host.base / "authorized_keys"
    lab_key = authorized.read_text()
    installer = cloud_init(host, isolated)
    try:
        res = gpuctl("up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
        installer.join(60)
        assert "waiting for SSH on root@" in res.stderr and "SSH works" in res.stderr
        (inst,) = live_instances(aws)
        proj = make_project("e2e", {"train.py": TF_TRAIN})
        out = gpuctl("train", proj, "--allow-cpu", "--wait", "--", "--epochs", "2")
        assert "Epoch 2/2" in out.stdout
        run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
        assert run["state"] == "succeeded" and run["cluster"] == "default"
        # Which TensorFlow and which image the run had (status and cost --compare show them).
        assert run["tensorflow"].startswith("2.") and inst["ImageId"] in run["image"]
        assert "Epoch 1/2" in gpuctl("logs", run["run_id"]).stdout
        cost = json.loads(gpuctl("cost", "--json").stdout)
        (rc,) = cost["runs"]
        assert [e["epoch"] for e in rc["epochs"]] == [1, 2]
        assert rc["usd_per_hour"] > 0 and all(e["epoch_cost_usd"] > 0 for e in rc["epochs"])
        assert cost["clusters"][0]["provider"] == "aws"
        assert host.run(f"cat /srv/gpuctl/runs/{run['run_id']}/exitcode").stdout.strip() == "0"
        gpuctl("down", "-y")
        nothing_created(aws)
        assert aws.describe_instances(InstanceIds=[inst["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated"
        assert json.loads(gpuctl("cost", "--json").stdout)["runs"][0]["epochs"][1]["epoch"] == 2
    finally:
        authorized.write_text(lab_key)


def test_host_keys_are_pinned_by_instance_not_by_recycled_address(gpuctl, aws, ssh, monkeypatch, isolated):
    """EC2 recycles public IPs. Here every instance is the same test host (one
    address): its key is changed between two `up`s, as a new machine on an old address would be."""
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={host.ip}")
    authorized = host.base / "authorized_keys"
    lab_key = authorized.read_text()
    known = isolated / "known_hosts"
    try:
        installer = cloud_init(host, isolated)
        gpuctl("up", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
        installer.join(60)
        (inst,) = live_instances(aws)
        assert known.read_text().startswith(f"gpuctl-{inst['InstanceId']} ") and host.ip not in known.read_text()
        # The same instance with another key: refused, by gpuctl and by OpenSSH alike.
        host.new_host_key()
        host.restart()
        res = gpuctl("exec", "--", "true", code=7)
        assert "has CHANGED" in res.stderr and f"(gpuctl-{inst['InstanceId']})" in res.stderr, res.stderr
        gpuctl("down", "-y")
        assert f"gpuctl-{inst['InstanceId']}" not in known.read_text()  # its pin went with it
        # A new instance on the recycled address, with its own key: welcome (refused before).
        host.new_host_key()
        host.restart()
        authorized.write_text(lab_key)
        installer = cloud_init(host, isolated)
        gpuctl("up", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
        installer.join(60)
        assert gpuctl("exec", "--", "true").exit_code == 0
        gpuctl("down", "-y")
    finally:
        authorized.write_text(lab_key)
