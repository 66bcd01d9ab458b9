"""A spot interruption notice, end to end on real parts: a moto-launched spot instance mapped to a
real sshd host, its real watchdog polling a fake IMDSv2 (token required) that the test makes
announce the interruption in the middle of epoch 3 of a job (a plain-Python one that checkpoints
as Keras would, test_resume.RESUMABLE: the stop at a batch end inside Keras's fit is
test_payload_tf's and test_spot_nodes').

The job stops as preempted (exit 75), epochs 1-2 reported and checkpointed, the cut epoch neither
reported nor checkpointed; EC2 then takes the instance (moto's backend, state reason
Server.SpotInstanceTermination). With checkpoints on the instance's disk (aws.checkpoints =
"instance"), nothing can resume it: `train --resume` says why and launches nothing.
"""

from __future__ import annotations

import json

from tests.aws import ACCOUNT, REGION, live_instances
from tests.integration.test_aws_e2e import cloud_init
from tests.integration.test_resume import RESUMABLE
from tests import waits


def spot_terminate(instance_id: str) -> None:
    """What EC2 does two minutes after the notice, done in the ThreadedMotoServer's backend (moto
    has no API to interrupt a spot instance)."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    inst = ec2_backends[ACCOUNT][REGION].get_instance(instance_id)
    inst.terminate()
    inst.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                    "Server.SpotInstanceTermination")


def wait_for(what: str, test, timeout: float = 180, every: float = 0.3):
    return waits.wait_for(test, timeout, what, every)


def epochs_on(host, run_id: str) -> list[dict]:
    text = host.run(f"cat /srv/gpuctl/runs/{run_id}/epochs.jsonl 2>/dev/null").stdout
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def spot_env(monkeypatch, host, imds, checkpoints: str = "instance") -> None:
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={host.ip}")
    monkeypatch.setenv("GPUCTL_AWS__IMDS_ENDPOINT", imds.url(host))
    monkeypatch.setenv("GPUCTL_AWS__IMDS_POLL_S", "1")  # the notice heard within a second, not five
    monkeypatch.setenv("GPUCTL_AWS__CHECKPOINTS", checkpoints)


def test_notice_stops_the_run_as_preempted_at_a_batch_end(gpuctl, aws, ssh, imds, make_project, monkeypatch,
                                                          isolated):
    host = ssh.hosts[0]
    spot_env(monkeypatch, host, imds)
    lab_key = (host.base / "authorized_keys").read_text()
    try:
        installer = cloud_init(host, isolated)
        gpuctl("up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
        installer.join(60)
        (inst,) = live_instances(aws)
        proj = make_project("resumable", {"train.py": RESUMABLE})
        run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json", "--", "--epochs", "6").stdout)["run"]["run_id"]

        wait_for("epoch 2's report", lambda: len(epochs_on(host, run_id)) >= 2)
        imds.interrupt(host)  # as epoch 3 begins
        code = wait_for("the job's exit", lambda: host.run(f"cat /srv/gpuctl/runs/{run_id}/exitcode 2>/dev/null")
                        .stdout.strip(), timeout=60)
        assert code == "75"
        # The watchdog asked with a token, every time, and recorded what it heard.
        asked = imds.gets("/latest/meta-data/spot/instance-action")
        assert asked and all(asked)
        notice = json.loads(host.run("cat /srv/gpuctl/guard/notice.json").stdout)
        assert notice["action"] == "terminate" and notice["seen_at"]
        assert "NOTICE spot interruption" in gpuctl("logs", "--guard").stdout
        assert "preempted: the last whole epoch's checkpoint is kept" in gpuctl("logs", run_id).stdout
        # Epochs 1-2 reported, the cut epoch 3 not; the checkpoint is epoch 2's.
        assert [e["epoch"] for e in epochs_on(host, run_id)] == [1, 2]
        status = next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)
        assert status["state"] == "preempted" and status["exit_code"] == 75 and status["epoch"] == 2

        # EC2 takes the instance; the cluster is down by EC2's word and the run's checkpoint went with
        # its disk: --resume says so and launches nothing.
        spot_terminate(inst["InstanceId"])
        gpuctl("status")
        res = gpuctl("train", "--resume", run_id, code=4)
        assert "checkpoint" in res.stderr and "aws.checkpoints" in res.stderr
        assert live_instances(aws) == []
    finally:
        (host.base / "authorized_keys").write_text(lab_key)
