"""Managed recovery end to end, on real parts: a moto server (ThreadedMotoServer: the test ends the
spot instance in its backend with state reason Server.SpotInstanceTermination, as EC2 would), two
real sshd hosts (the first instance is mapped to the first host, every later one to the second),
the fake IMDSv2 (the notice for the first host alone; the instance role's credentials for both),
S3 in moto reached by the hosts.

1. The notice arrives during epoch 3 of 6: the job stops as preempted, its checkpoint and reports
   are in S3; `train --wait` waits for EC2 to end the instance (it is free then), launches a
   replacement, and the run finishes there: epochs 1-6 once, two segments, both instances in the
   cost, the cut epoch as lost work. A plain-Python job that checkpoints as Keras would
   (test_resume.RESUMABLE): the stop at a batch end inside Keras's fit is test_payload_tf's.
2. No notice: the instance vanishes (EC2 ends it, the host is gone). `train --wait` notices, and the
   run resumes on the replacement from the last epoch in S3. Real TensorFlow (marked tf): the
   launcher's Keras hook is what puts each epoch's checkpoint in S3.
3. Recovery that cannot get capacity gives up after recover.max_attempts, naming every try.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from urllib.parse import urlparse

import pytest

from gpuctl.ledger import Ledger
from tests.aws import live_instances, moto_client
from tests.integration.test_aws import _fail_run_instances
from tests.integration.test_resume import RESUMABLE, SLOW
from tests.integration.test_spot_notice import epochs_on, spot_terminate, wait_for


@pytest.fixture
def spot_lab(aws, monkeypatch, ssh, imds, moto_server, isolated):
    """The first instance is the first host, every later one the second; both reach the IMDS and S3
    at the lab's services address, and accept the cluster's key once it exists (cloud-init)."""
    h0, h1 = ssh.hosts
    with spot_world(monkeypatch, imds, moto_server, isolated, (h0, h1)):
        monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={h0.ip}")
        yield h0, h1


@contextlib.contextmanager
def spot_world(monkeypatch, imds, moto_server, isolated, hosts):
    """Settings and seams for spot instances played by `hosts`: they reach the IMDS and S3 at the
    lab's services address, and accept the cluster's key once `up` made it (cloud-init)."""
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_AWS__IMDS_ENDPOINT", imds.url(hosts[0]))
    monkeypatch.setenv("GPUCTL_AWS__IMDS_POLL_S", "1")  # the notice heard within a second, not five
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", f"http://{hosts[0].services_ip}:{urlparse(moto_server).port}")
    imds.role("gpuctl-instance-role")  # boto3 on the hosts reads its credentials here, as on EC2
    imds.reached_by(hosts)
    from gpuctl.ops import recovery
    from gpuctl.provision.aws import lifecycle

    monkeypatch.setattr(lifecycle, "EC2_POLL_S", 0.5)
    monkeypatch.setattr(recovery, "CHECK_INSTANCES_S", 2.0)
    monkeypatch.setattr(recovery, "RETRY_S", 0.0)
    saved = [(h, (h.base / "authorized_keys").read_text()) for h in hosts]

    def install():
        wait_for("the cluster's key", lambda: list((isolated / "keys").glob("default.us-east-1.pub")), 60)
        time.sleep(1.0)
        pub = (isolated / "keys" / "default.us-east-1.pub").read_text()
        for h, text in saved:
            (h.base / "authorized_keys").write_text(text + pub)

    threading.Thread(target=install, daemon=True).start()
    try:
        yield
    finally:
        for h, text in saved:
            (h.base / "authorized_keys").write_text(text)


def up_first(gpuctl, aws, monkeypatch, h0, h1):
    gpuctl("up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "-y")
    (inst,) = live_instances(aws)
    # Later instances (replacements) are the second host; "*" first: the last match wins.
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={h1.ip},{inst['PublicIpAddress']}={h0.ip}")
    return inst


def train_in_background(gpuctl, args, code=0):
    out: dict = {}

    def go():
        try:
            out["res"] = gpuctl(*args, code=code)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


def finished(thread, out, timeout: float = 400):
    """The background command's result, once it ended (its exception, raised here)."""
    thread.join(timeout)
    assert not thread.is_alive(), "the command did not finish"
    if "error" in out:
        raise out["error"]
    return out["res"]


def stored_keys(_ec2, run_id):
    s3 = moto_client("s3")
    (bucket,) = [b["Name"] for b in s3.list_buckets()["Buckets"] if b["Name"].startswith("gpuctl-")]
    # clusters/default.<id>/: the cluster's own place, not shared with a later cluster of the same name
    res = s3.list_objects_v2(Bucket=bucket, Prefix="clusters/default.")
    return [o["Key"].split(f"runs/{run_id}/", 1)[1] for o in res.get("Contents", []) if f"/runs/{run_id}/" in o["Key"]]


def run_id_on(host, out) -> str:
    def started():
        if "error" in out or "res" in out:
            raise AssertionError(f"train ended before its run started: {out}")
        return host.run("ls /srv/gpuctl/runs 2>/dev/null").stdout.split()[:1]

    return wait_for("the run's directory", started)[0]


def train_to_epoch_2(gpuctl, aws, monkeypatch, h0, h1, make_project, script: str, epochs: int):
    """`up` (the first host), then `train --wait` in the background until epoch 2 is reported."""
    first = up_first(gpuctl, aws, monkeypatch, h0, h1)
    proj = make_project("slow", {"train.py": script})
    thread, out = train_in_background(gpuctl, ("train", proj, "--allow-cpu", "--wait", "--", "--epochs", str(epochs)))
    run_id = run_id_on(h0, out)
    wait_for("epoch 2's report", lambda: len(epochs_on(h0, run_id)) >= 2)
    return first, thread, out, run_id


def test_a_notice_mid_epoch_3_and_the_run_finishes_on_a_replacement(gpuctl, aws, spot_lab, imds, make_project,
                                                                     monkeypatch):
    h0, h1 = spot_lab
    first, thread, out, run_id = train_to_epoch_2(gpuctl, aws, monkeypatch, h0, h1, make_project, RESUMABLE, 6)
    notice_at = time.time()
    imds.interrupt(h0)  # as epoch 3 begins
    assert wait_for("the job's exit", lambda: h0.run(f"cat /srv/gpuctl/runs/{run_id}/exitcode 2>/dev/null")
                    .stdout.strip(), timeout=60) == "75"
    # In S3 before the instance goes: epoch 2's checkpoint and the reports.
    keys = stored_keys(aws, run_id)
    assert "epochs.jsonl" in keys and any(k.startswith("outputs/checkpoint/") for k in keys), \
        h0.run(f"cat /srv/gpuctl/runs/{run_id}/output.log /srv/gpuctl/runs/{run_id}/run.json").stdout
    time.sleep(2.0)  # EC2 ends it a while after the notice (two minutes on AWS)
    spot_terminate(first["InstanceId"])
    h0.stop()  # and with it everything that ran there
    res = finished(thread, out)
    # Recovery waited for EC2 to end it ("letting EC2 end ..."), unless its look at EC2 (every 2 s
    # here) saw it ended first; either way gpuctl never ended it (that would be billed).
    assert f"terminating {first['InstanceId']}" not in res.stderr and f"run {run_id} resumed on i-" in res.stderr
    assert "restored the run's checkpoint and reports from the store" in res.stdout
    assert "final accuracy" in res.stdout and "Epoch 6/6" in res.stdout

    (second,) = live_instances(aws)
    assert second["InstanceId"] != first["InstanceId"]
    assert [e["epoch"] for e in epochs_on(h1, run_id)] == [1, 2, 3, 4, 5, 6]
    run = next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)
    assert run["state"] == "succeeded" and run["epoch"] == 6
    assert [(g["instance_id"], g["end"]) for g in run["segments"]] == [
        (first["InstanceId"], "preempted"), (second["InstanceId"], "succeeded")]
    assert f"resumed on {second['InstanceId']}" in gpuctl("status").stdout
    cost = json.loads(gpuctl("cost", "--json", run_id).stdout)
    (rc,) = cost["runs"]
    assert [e["epoch"] for e in rc["epochs"]] == [1, 2, 3, 4, 5, 6]  # each once
    a, b = rc["segments"]
    # The first instance: interrupted by EC2 in its first hour, so not billed; its cut epoch 3 is lost
    # work: from epoch 2's end to the end of its stretch there, which came after the notice (this
    # machine's clock is the test host's). It was `> 0.5`, which a notice heard at once after a
    # quick epoch 2 fell short of (0.48 s).
    epoch_2_end = epochs_on(h1, run_id)[1]["end"]  # as reported on the first instance
    assert a["free"] and a["usd"] == 0 and a["ended_at"] >= notice_at > epoch_2_end, (a, notice_at, epoch_2_end)
    assert a["lost_s"] == pytest.approx(a["ended_at"] - epoch_2_end, abs=1e-3), (a, epoch_2_end)
    assert b["usd"] > 0 and b["waited_s"] > 0
    assert rc["instances_usd"] == pytest.approx(b["usd"]) and rc["lost_s"] == pytest.approx(a["lost_s"])
    text = gpuctl("cost", run_id).stdout
    assert "lost work" in text and "(free)" in text
    gpuctl("down", "-y")
    assert live_instances(aws) == []
    assert stored_keys(aws, run_id)  # down keeps the run's checkpoints


@pytest.mark.tf
def test_an_instance_that_vanishes_without_notice_is_replaced(gpuctl, aws, spot_lab, imds, make_project, monkeypatch):
    h0, h1 = spot_lab
    first, thread, out, run_id = train_to_epoch_2(gpuctl, aws, monkeypatch, h0, h1, make_project, SLOW, 4)
    wait_for("epoch 2 in S3", lambda: "epochs.jsonl" in stored_keys(aws, run_id))
    spot_terminate(first["InstanceId"])  # no notice came (they are best effort)
    h0.stop()
    res = finished(thread, out)
    assert f"run {run_id} resumed on i-" in res.stderr
    assert "letting EC2 end" not in res.stderr  # it had ended already
    # The report file may hold an epoch twice (reported, then cut before its checkpoint reached S3,
    # then run again); the ledger keeps each epoch once.
    (rc,) = json.loads(gpuctl("cost", "--json", run_id).stdout)["runs"]
    assert [e["epoch"] for e in rc["epochs"]] == [1, 2, 3, 4]


def _event(home, kind: str, run_id: str) -> bool:
    ledger = Ledger(home)
    try:
        return any(k == kind and run == run_id for _, _, run, k, _ in ledger.events())
    finally:
        ledger.close()


def test_recovery_gives_up_after_max_attempts_naming_each_try(gpuctl, aws, spot_lab, imds, make_project, monkeypatch,
                                                              isolated):
    h0, h1 = spot_lab
    monkeypatch.setenv("GPUCTL_RECOVER__MAX_ATTEMPTS", "2")
    first = up_first(gpuctl, aws, monkeypatch, h0, h1)
    proj = make_project("sleepy", {"train.py": "import time\nprint('working', flush=True)\ntime.sleep(600)\n"})
    thread, out = train_in_background(gpuctl, ("train", proj, "--allow-cpu", "--wait"), code=8)
    run_id = run_id_on(h0, out)
    wait_for("the job", lambda: "working" in h0.run(f"cat /srv/gpuctl/runs/{run_id}/output.log").stdout)
    # And `train` done starting it (the watchdog re-armed, the start recorded), following it now: the
    # job prints at once without TensorFlow to import, and the host went while `train` still
    # re-armed the watchdog there (exit 7, lost connection) instead of during the follow.
    wait_for("train's start recorded", lambda: _event(isolated, "train", run_id))
    seen = _fail_run_instances(monkeypatch, lambda z, m: "InsufficientInstanceCapacity")
    spot_terminate(first["InstanceId"])
    h0.stop()
    err = finished(thread, out, 300).stderr
    assert "recovery gave up after 2 tries" in err and "try 1:" in err and "try 2:" in err
    assert f"gpuctl train --resume {run_id}" in err and seen  # every zone was asked, twice
    assert live_instances(aws) == []  # nothing half-launched is left
    run = next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)
    # A plain script writes no checkpoint: status offers no resume from one (test_small_cli_37.py).
    assert run["state"] == "preempted" and run["resumable"] is False
