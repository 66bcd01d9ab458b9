"""`train --data s3://...` on an ssh cluster of two real sshd test hosts (network namespaces): each
node fetches the data set itself, at once, from the tests' moto S3 (which they reach through
their gateway, GPUCTL_TEST_S3_ENDPOINT, as an instance reaches S3), with presigned links made
here: no AWS key or secret is ever on the hosts. A second train fetches nothing on either."""

from __future__ import annotations

import json
import os
from urllib.parse import urlparse

from tests.aws import moto_client
from tests.integration.test_s3_data import READER, md5, put
from tests.integration.test_ssh import up_ssh
from tests.integration.test_spot_recovery import spot_lab  # noqa: F401, F811  (fixture)
from tests.sshd import ROOT

SECRET = "s3cr3t-never-on-a-host"


def test_two_ssh_nodes_fetch_the_data_set_themselves_with_links_and_keep_it(gpuctl, ssh, aws, moto_server,
                                                                            make_project, monkeypatch):
    h1, h2 = ssh.hosts[:2]
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", f"http://{h1.services_ip}:{urlparse(moto_server).port}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto takes any: one to look for on the hosts
    s3 = moto_client("s3")
    body = os.urandom(300_000)
    put(s3, {"imgs/a.bin": body, "imgs/sub/b.txt": b"bee\n"})
    proj = make_project("reader", {"train.py": READER})
    up_ssh(gpuctl, ssh, h1, h2)

    out = gpuctl("train", proj, "--data", "s3://training-data/imgs", "--allow-cpu", "--json")
    result = json.loads(out.stdout)
    assert result["data_fetch"]["fetched"] == 2, out.stderr
    assert "this host is outside AWS, so S3 bills transfer out to the internet: $0.09/GB" in out.stderr
    run = result["run"]
    log = gpuctl("logs", "-f", run["run_id"]).stdout
    assert f"file a.bin {md5(body)}" in log and f"file sub/b.txt {md5(b'bee' + bytes([10]))}" in log
    store = result["data_fetch"]["data_dir"]
    assert store.startswith(f"{ROOT}/data/s3-training-data-")
    for host in (h1, h2):  # every node has it, fetched there
        assert host.run(f"md5sum {store}/a.bin").stdout.split()[0] == md5(body)
        # The host saw links only: no key, no secret, no credentials file anywhere under gpuctl's root.
        leaked = host.run(f"grep -rl -e {SECRET} {ROOT} 2>/dev/null; ls -a ~/.aws 2>/dev/null").stdout
        assert leaked.strip() == "", leaked
        assert host.run(f"ls {store}/../.{store.rsplit('/', 1)[1]}.gpuctl-fetch").stdout.split() == ["lock", "manifest.json", "parts"]

    again = json.loads(gpuctl("train", proj, "--data", "s3://training-data/imgs/", "--allow-cpu", "--json").stdout)
    assert (again["data_fetch"]["fetched"], again["data_fetch"]["cached"]) == (0, 2)


def test_on_aws_the_instance_reads_the_data_set_with_its_own_role_limited_to_that_prefix(gpuctl, aws, spot_lab,  # noqa: F811
                                                                                         imds, make_project,
                                                                                         isolated, monkeypatch):
    """An aws cluster (moto) whose instance is a real sshd host: `train` lets the cluster's role
    read exactly the data set's prefix (its gpuctl-data policy), and the instance signs its own
    GETs with the role's credentials from its (fake) IMDSv2: no link made here, no key there."""
    from gpuctl.provision.aws import store_iam
    from tests.integration.test_spot_recovery import up_first

    h0, h1 = spot_lab
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    put(moto_client("s3"), {"ds/x.bin": b"x" * 5000, "ds/y/z.txt": b"zed", "other/secret": b"not for it"})
    proj = make_project("reader", {"train.py": READER})
    up_first(gpuctl, aws, monkeypatch, h0, h1)
    out = gpuctl("train", proj, "--data", "s3://training-data/ds", "--allow-cpu", "--json")
    assert "in the cluster's region: no transfer charge" in out.stderr
    assert "data: the cluster's role may read s3://training-data/ds/ (s3:GetObject, that prefix only)" in out.stderr, out.stderr
    result = json.loads(out.stdout)
    assert result["data_fetch"]["fetched"] == 2
    assert "file y/z.txt" in gpuctl("logs", "-f", result["run"]["run_id"]).stdout
    owner = (isolated / "owner").read_text().strip()
    role = store_iam.profile_name(owner, "default", "us-east-1")
    policy = moto_client("iam").get_role_policy(RoleName=role, PolicyName="gpuctl-data")["PolicyDocument"]
    assert policy["Statement"] == [{"Sid": "ReadTheDataSet", "Effect": "Allow", "Action": "s3:GetObject",
                                    "Resource": "arn:aws:s3:::training-data/ds/*"}]
    assert any(imds.gets("/latest/meta-data/iam/security-credentials/gpuctl-instance-role"))
    assert h0.run(f"grep -rl {SECRET} {ROOT} 2>/dev/null").stdout.strip() == ""


def test_on_aws_upload_dirs_sends_a_directory_up_once_and_the_instance_fetches_it_in_region(
        gpuctl, aws, spot_lab, imds, make_project, isolated, monkeypatch, tmp_path):  # noqa: F811
    """`[data] upload_dirs` on: `train --data DIR` on an aws cluster (moto; its instance a real
    sshd host) uploads DIR to the gpuctl bucket as a data set, and the instance fetches it from
    there with its role: nothing pushed over SSH. The next train uploads and fetches nothing."""
    from tests.integration.test_spot_recovery import up_first

    h0, h1 = spot_lab
    monkeypatch.setenv("GPUCTL_DATA__UPLOAD_DIRS", "true")
    src = tmp_path / "Train_Set"
    (src / "y").mkdir(parents=True)
    (src / "x.bin").write_bytes(b"x" * 5000)
    (src / "y" / "z.txt").write_bytes(b"zed")
    proj = make_project("reader", {"train.py": READER})
    up_first(gpuctl, aws, monkeypatch, h0, h1)
    out = gpuctl("train", proj, "--data", src, "--allow-cpu", "--json")
    assert "goes up as the data set train-set-" in out.stderr and "2 file(s) uploaded, 0 already there" in out.stderr
    result = json.loads(out.stdout)
    assert result["data_sync"] is None and result["data_fetch"]["fetched"] == 2
    assert result["run"]["data"].startswith("s3://gpuctl-") and "/data/train-set-" in result["run"]["data"]
    seen = gpuctl("logs", "-f", result["run"]["run_id"]).stdout
    assert "file y/z.txt" in seen and "file x.bin" in seen
    (listed,) = json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"]
    assert listed["name"].startswith("train-set-") and listed["files"] == 2 and listed["source_dir"] == str(src)
    again = gpuctl("train", proj, "--data", src, "--allow-cpu", "--json")
    assert "0 file(s) uploaded, 2 already there" in again.stderr
    assert json.loads(again.stdout)["data_fetch"]["fetched"] == 0
