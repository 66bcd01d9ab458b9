"""Issue 11, items 1, 2 and 4 on a real sshd test host: the tar stream for hosts without rsync,
a push killed half-way, pulls of what a hostile instance holds, and syncs racing each other.

Bad inputs tried: `kill -9` of gpuctl in the middle of a 48 MB push without rsync; a run's
outputs holding links to /root/.ssh, to /etc/passwd, up and out of the run, a dangling link and
a FIFO, pulled with rsync and without; eight syncs of one project to one cluster at once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tests.integration.test_guards import wait_for
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT

GPUCTL = [sys.executable, "-m", "gpuctl"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remote_sha(host, path: str) -> str:
    return host.run(f"sha256sum {path}").stdout.split()[0]


def test_a_push_killed_half_way_without_rsync_leaves_each_file_old_or_whole(gpuctl, ssh, make_project):
    host = ssh.hosts[0]
    host.restart(hidden=("/usr/bin/rsync",))
    up_ssh(gpuctl, ssh)
    proj = make_project("big", {"train.py": "pass\n"})
    old = os.urandom(48 * 1024 * 1024)
    (proj / "weights.bin").write_bytes(old)
    gpuctl("sync", str(proj))
    assert remote_sha(host, f"{ROOT}/code/big/weights.bin") == sha(old)
    new = os.urandom(48 * 1024 * 1024)
    (proj / "weights.bin").write_bytes(new)
    client = subprocess.Popen([*GPUCTL, "sync", str(proj)], env=dict(os.environ), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Killed once the new content is on its way (a temporary file is growing on the host).
    wait_for(lambda: int(host.run(f"stat -c %s {ROOT}/code/big/.weights.bin.*.gpuctl-tmp 2>/dev/null || echo 0")
                         .stdout.split()[0]) > 1024 * 1024, timeout=60, every=0.05)
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    # The host's unpacker sees the stream end, drops its temporary file; the old file is whole.
    wait_for(lambda: not host.run(f"ls -a {ROOT}/code/big | grep gpuctl-tmp").stdout.strip(), timeout=20)
    assert remote_sha(host, f"{ROOT}/code/big/weights.bin") == sha(old)
    gpuctl("sync", str(proj))
    assert remote_sha(host, f"{ROOT}/code/big/weights.bin") == sha(new)


def plant_hostile_outputs(host, run_dir: str) -> None:
    out = f"{run_dir}/outputs"
    host.run(f"mkdir -p {out}/deep && echo weights > {out}/model.txt && echo d > {out}/deep/d.txt && "
             f"ln -s /root/.ssh {out}/keys && ln -s /etc/passwd {out}/passwd && ln -s ../../../.. {out}/up && "
             f"ln -s model.txt {out}/alias && ln -s ../model.txt {out}/deep/back && ln -s /nonexistent {out}/gone && "
             f"mkfifo {out}/pipe")


def test_pull_keeps_everything_a_hostile_instance_holds_inside_the_target(gpuctl, ssh, make_project, tmp_path):
    host = ssh.hosts[0]
    for rsync in (True, False):
        if not rsync:
            gpuctl("down", "-y")
            host.restart(hidden=("/usr/bin/rsync",))  # the documented fallback: SFTP
        up_ssh(gpuctl, ssh)
        proj = make_project(f"outs{rsync}", {"train.py": "print('done')\n"})
        run = json.loads(gpuctl("train", str(proj), "--allow-cpu", "--wait", "--json").stdout)["run"]
        plant_hostile_outputs(host, run["run_dir"])
        dest = tmp_path / f"back-{rsync}"
        res = gpuctl("pull", run["run_id"], "--dest", str(dest))
        got = dest / run["run_id"] / "outputs"
        assert (got / "model.txt").read_text() == "weights\n" and (got / "deep" / "d.txt").exists()
        assert os.readlink(got / "alias") == "model.txt" and os.readlink(got / "deep" / "back") == "../model.txt"
        for name in ("keys", "passwd", "up", "gone", "pipe"):
            assert not os.path.lexists(got / name), (rsync, name)
        assert not any(p.name in ("authorized_keys", "id_ed25519") for p in dest.rglob("*"))
        if not rsync:  # the SFTP walk says what it left out
            assert "entries not pulled" in res.stderr and "keys: a link leading out of the run" in res.stderr


def test_eight_syncs_of_one_project_at_once_all_succeed(gpuctl, ssh, make_project):
    up_ssh(gpuctl, ssh)
    proj = make_project("racing", {f"f{i}.py": str(i) for i in range(50)})

    def sync(_):
        return subprocess.run([*GPUCTL, "sync", str(proj)], capture_output=True, text=True, timeout=120)

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(sync, range(8)))
    assert [r.returncode for r in results] == [0] * 8, [r.stderr for r in results if r.returncode]
    print(f"figure: 8 concurrent syncs in {time.monotonic() - t0:.1f}s")
    assert ssh.hosts[0].run(f"ls {ROOT}/code/racing | wc -l").stdout.strip() == "50"


def test_the_whole_ssh_loop_with_a_home_holding_spaces_and_non_ascii(gpuctl, ssh, quick_project, isolated,
                                                                    monkeypatch, tmp_path):
    """Item 5: on macOS the default home is `~/Library/Application Support/gpuctl`; every OpenSSH
    and rsync call (the generated config, UserKnownHostsFile, the keys) must take such a path."""
    home = tmp_path / "Library" / "Application Support" / "gpüctl hôme"
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    up_ssh(gpuctl, ssh)
    res = gpuctl("train", str(quick_project), "--allow-cpu", "--wait")
    assert "done" in res.stdout
    assert gpuctl("ssh", "--", "true").exit_code == 0
    gpuctl("ssh-config", "--install")
    user_cfg = tmp_path / "user" / ".ssh" / "config"
    assert user_cfg.read_text().startswith(f'Include "{home / "ssh_config"}"')
    out = subprocess.run(["ssh", "-F", str(user_cfg), "-o", "BatchMode=yes", "box", "hostname -I"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == ssh.hosts[0].ip, out.stderr
    run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    gpuctl("pull", run_id, "--dest", str(tmp_path / "pulled here"))
    assert (tmp_path / "pulled here" / run_id / "output.log").exists()
