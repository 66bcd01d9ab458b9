"""A spot interruption of a cluster with a volume (moto + sshd test hosts, as
test_spot_recovery.py): the replacement is launched in the volume's zone, the volume is attached
to it once EC2 let go of it, mounted there (a loop device stands for it: seam
GPUCTL_TEST_VOLUME_DEVICES) without formatting, and the resumed job finds what the first
instance's job wrote under $GPUCTL_VOLUME_DIR."""

import json
import time

import pytest

from tests.aws import live_instances, moto_client
from tests.integration.test_resume import RESUMABLE
from tests.integration.test_spot_notice import epochs_on, spot_terminate, wait_for
from tests.integration.test_spot_recovery import finished, run_id_on, spot_world, train_in_background

MOUNTED = "/mnt/gpuctl/data"
# RESUMABLE, saying on the volume where each of its starts ran.
ON_THE_VOLUME = RESUMABLE.replace("epochs = int(", '''
with open(os.path.join(os.environ["GPUCTL_VOLUME_DIR"], "starts.txt"), "a") as fh:
    fh.write(os.environ["GPUCTL_RUN_ID"] + "\\n")
print("starts:", open(os.path.join(os.environ["GPUCTL_VOLUME_DIR"], "starts.txt")).read().split(), flush=True)
epochs = int(''', 1)


@pytest.fixture
def spot_lab(aws, monkeypatch, ssh, imds, moto_server, isolated):
    """The first instance is the first host, every later one the second (test_spot_recovery.py's)."""
    h0, h1 = ssh.hosts
    with spot_world(monkeypatch, imds, moto_server, isolated, (h0, h1)):
        monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={h0.ip}")
        yield h0, h1


def test_the_replacement_of_an_interrupted_chief_gets_the_volume_and_its_files(
        gpuctl, aws, spot_lab, imds, make_project, monkeypatch, loop_device):
    h0, h1 = spot_lab
    monkeypatch.setenv("GPUCTL_TEST_VOLUME_DEVICES", f"*={loop_device(64)}")
    made = json.loads(gpuctl("volume", "create", "data", "--size", "10", "-y", "--json").stdout)
    try:
        gpuctl("up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--volume", "data", "-y")
        (first,) = live_instances(aws)
        monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", f"*={h1.ip},{first['PublicIpAddress']}={h0.ip}")
        proj = make_project("onvolume", {"train.py": ON_THE_VOLUME})
        thread, out = train_in_background(gpuctl, ("train", proj, "--allow-cpu", "--wait", "--", "--epochs", "4"))
        run_id = run_id_on(h0, out)
        wait_for("epoch 2's report", lambda: len(epochs_on(h0, run_id)) >= 2)
        imds.interrupt(h0)
        assert wait_for("the job's exit", lambda: h0.run(f"cat /srv/gpuctl/runs/{run_id}/exitcode 2>/dev/null")
                        .stdout.strip(), timeout=60) == "75"
        time.sleep(1.0)
        spot_terminate(first["InstanceId"])
        h0.stop()  # and its mount of the volume with it
        res = finished(thread, out)
        assert f"run {run_id} resumed on i-" in res.stderr and "Epoch 4/4" in res.stdout
        (second,) = live_instances(aws)
        assert second["Placement"]["AvailabilityZone"] == made["zone"]
        (vol,) = moto_client("ec2").describe_volumes(VolumeIds=[made["id"]])["Volumes"]
        assert [a["InstanceId"] for a in vol["Attachments"] if a.get("State") == "attached"] == [second["InstanceId"]]
        # Written on the first instance, read on the replacement: one line per start of the job.
        assert h1.run(f"cat {MOUNTED}/starts.txt").stdout.split() == [run_id, run_id]
        gpuctl("down", "-y")
    finally:
        h1.run(f"umount {MOUNTED} 2>/dev/null; rmdir {MOUNTED} /mnt/gpuctl 2>/dev/null; true")
