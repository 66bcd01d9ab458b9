"""Volumes on the ssh provider, on real sshd test hosts (tests/sshd.py): a named directory on the
user's host (remote.workdir/_volumes/NAME), written by one cluster's job, kept by `down`, read by
the next cluster's; a cluster whose first --host is another host is refused (one line, nothing
started); `volume rm` deletes the directory on the host."""

import json

from tests.integration.test_ssh import up_ssh
from tests.integration.test_volumes import READ, WRITE
from tests.sshd import WORKDIR


def test_an_ssh_volume_outlives_down_and_the_next_cluster_reads_it(gpuctl, ssh, make_project, monkeypatch):
    monkeypatch.setenv("GPUCTL_SSH__IDENTITY", str(ssh.key))
    host, other = ssh.hosts[0], ssh.hosts[1]
    made = json.loads(gpuctl("volume", "create", "data", "--size", "2", "--provider", "ssh", "--host", host.address,
                             "--json").stdout)
    path = f"{WORKDIR}/_volumes/data"
    assert made["path"] == path and made["host"] == host.address
    assert host.run(f"test -d {path}").returncode == 0 and other.run(f"test -e {path}").returncode != 0

    up_ssh(gpuctl, ssh, name="first", extra=("--volume", "data"))
    out = gpuctl("train", make_project("writer", {"train.py": WRITE}), "--allow-cpu", "--wait").stdout
    assert f"wrote {path}" in out
    gpuctl("down", "first", "-y")
    assert host.run(f"cat {path}/dataset.txt").stdout == "fetched once\n"

    err = up_ssh(gpuctl, ssh, other, name="elsewhere", extra=("--volume", "data"), code=3).stderr
    assert err.startswith(f"Error: volume 'data' is on {host.address}; this cluster's first --host is {other.address}")

    up_ssh(gpuctl, ssh, name="second", extra=("--volume", "data"))
    out = gpuctl("train", make_project("reader", {"train.py": READ}), "--allow-cpu", "--wait").stdout
    assert "read: fetched once" in out
    gpuctl("down", "second", "-y")

    gpuctl("volume", "rm", "data", "-y")
    assert host.run(f"test -e {path}").returncode != 0
