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
