"""Push and pull on a real sshd test host: the tar stream for hosts without rsync,
a push killed half-way, pulls of what a hostile instance holds, and syncs racing each other.

Bad inputs tried: `kill -9` of gpuctl in the middle of a 48 MB push without rsync; a run's
outputs holding links to /root/.ssh, to /etc/passwd, up and out of the run, a dangling link and
a FIFO and a link whose name holds an escape sequence, pulled with rsync and without (each
listed as left out, in the output and in --json); a setuid, a setgid, a sticky directory, a 0600
file and files of a foreign owner in the outputs (pulled plain, twice); eight syncs of
one project to one cluster at once."""

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
    assert remote_sha(host, f"{ROOT}/code/big-*/weights.bin") == sha(old)
    new = os.urandom(48 * 1024 * 1024)
    (proj / "weights.bin").write_bytes(new)
    client = subprocess.Popen([*GPUCTL, "sync", str(proj)], env=dict(os.environ), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Killed once the new content is on its way (a temporary file is growing on the host).
    wait_for(lambda: int(host.run(f"stat -c %s {ROOT}/code/big-*/.weights.bin.*.gpuctl-tmp 2>/dev/null || echo 0")
                         .stdout.split()[0]) > 1024 * 1024, timeout=60, every=0.05)
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    # The host's unpacker sees the stream end, drops its temporary file; the old file is whole.
    wait_for(lambda: not host.run(f"ls -a {ROOT}/code/big-* | grep gpuctl-tmp").stdout.strip(), timeout=20)
    assert remote_sha(host, f"{ROOT}/code/big-*/weights.bin") == sha(old)
    gpuctl("sync", str(proj))
    assert remote_sha(host, f"{ROOT}/code/big-*/weights.bin") == sha(new)


def plant_hostile_outputs(host, run_dir: str) -> None:
    out = f"{run_dir}/outputs"
    host.run(f"mkdir -p {out}/deep && echo weights > {out}/model.txt && echo d > {out}/deep/d.txt && "
             f"ln -s /root/.ssh {out}/keys && ln -s /etc/passwd {out}/passwd && ln -s ../../../.. {out}/up && "
             f"ln -s model.txt {out}/alias && ln -s ../model.txt {out}/deep/back && ln -s /nonexistent {out}/gone && "
             f"mkfifo {out}/pipe && ln -s /etc \"{out}/esc$(printf '\\033')[31mred\"")

LEFT_OUT = {"keys": "a link leading out of the run (/root/.ssh)", "passwd": "a link leading out of the run",
            "up": "a link leading out of the run (../../../..)", "gone": "a link leading out of the run",
            "pipe": "not a regular file", "esc": "a link leading out of the run (/etc)"}


def assert_lists_left_out(skipped: list[str], where) -> None:
    """Every entry the pull left out is listed, by its path under the run and why; no control
    character of the instance's names reaches the list."""
    for name, why in LEFT_OUT.items():
        assert any(e.startswith(f"outputs/{name}") and why in e for e in skipped), (where, name, skipped)
    assert not any(c < " " for e in skipped for c in e), (where, skipped)


def test_pull_keeps_everything_a_hostile_instance_holds_inside_the_target(gpuctl, ssh, make_project, tmp_path):
    """And brings no setuid bit, foreign owner or wider mode: over rsync a 4755
    file landed -rwsr-xr-x (and root kept the instance's owner); over SFTP a 0600 file landed 0644."""
    host = ssh.hosts[0]
    old = os.umask(0o022)
    try:
        _pull_hostile_twice(gpuctl, ssh, host, make_project, tmp_path)
    finally:
        os.umask(old)


def _pull_hostile_twice(gpuctl, ssh, host, make_project, tmp_path) -> None:
    for rsync in (True, False):
        if not rsync:
            gpuctl("down", "-y")
            host.restart(hidden=("/usr/bin/rsync",))  # the documented fallback: SFTP
        up_ssh(gpuctl, ssh)
        proj = make_project(f"outs{rsync}", {"train.py": "print('done')\n"})
        data = tmp_path / f"data-{rsync}"
        data.mkdir()
        (data / "set.csv").write_text("a data set: it stays on the instance\n")
        run = json.loads(gpuctl("train", str(proj), "--data", str(data), "--allow-cpu", "--wait",
                                "--json").stdout)["run"]
        plant_hostile_outputs(host, run["run_dir"])
        host.run(PRIVILEGED.format(out=f"{run['run_dir']}/outputs"))
        dest = tmp_path / f"back-{rsync}"
        res = gpuctl("pull", run["run_id"], "--dest", str(dest), "--json")
        assert_lists_left_out(json.loads(res.stdout)["skipped"], f"rsync={rsync}")
        assert_pulled_plainly(dest / run["run_id"] / "outputs", f"rsync={rsync}")
        res = gpuctl("pull", run["run_id"], "--dest", str(dest))  # over the first: set again
        got = dest / run["run_id"] / "outputs"
        assert_pulled_plainly(got, f"rsync={rsync}, again")
        assert (got / "model.txt").read_text() == "weights\n" and (got / "deep" / "d.txt").exists()
        # The run's code copy comes back; its data copy stays, and the pull says so.
        assert (dest / run["run_id"] / "code" / "train.py").exists() and not (dest / run["run_id"] / "data").exists()
        assert "Left out data/: the run's copy of its data set" in res.stdout
        assert os.readlink(got / "alias") == "model.txt" and os.readlink(got / "deep" / "back") == "../model.txt"
        for name in ("keys", "passwd", "up", "gone", "pipe"):
            assert not os.path.lexists(got / name), (rsync, name)
        assert not any(p.name in ("authorized_keys", "id_ed25519") or p.name.startswith("esc") for p in dest.rglob("*"))
        # Both paths say what they left out (rsync's own words read back), with no escape sequence.
        assert "entries not pulled (6)" in res.stderr and "outputs/keys: a link leading out of the run" in res.stderr
        assert "\x1b" not in res.stderr


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
    assert ssh.hosts[0].run(f"ls {ROOT}/code/racing-* | wc -l").stdout.strip() == "50"


def test_the_whole_ssh_loop_with_a_home_holding_spaces_and_non_ascii(gpuctl, ssh, quick_project, isolated,
                                                                    monkeypatch, tmp_path):
    """On macOS the default home is `~/Library/Application Support/gpuctl`; every OpenSSH
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


# What a hostile (or careless) instance leaves in a run's outputs: a setuid and a setgid file, a
# sticky world-writable directory, a file of its owner's alone, and files of a foreign owner (chown
# first: it clears the setuid bit a chmod before it gave).
PRIVILEGED = ("mkdir -p {out}/sub && printf x > {out}/suid && printf s > {out}/secret && printf g > {out}/sub/sgid && "
              "chown 1234:1234 {out}/suid {out}/secret {out}/sub && chmod 4755 {out}/suid && chmod 600 {out}/secret && "
              "chmod 2775 {out}/sub/sgid && chmod 1777 {out}/sub && stat -c '%A %u %n' {out}/suid | grep -q '^-rws.* 1234 '")


def assert_pulled_plainly(got, where) -> None:
    """No special bit, no foreign owner, nothing wider than the instance's mode less the umask (022)."""
    for p in [got, *got.rglob("*")]:
        st = os.lstat(p)
        assert not st.st_mode & (0o4000 | 0o2000 | 0o1000), (where, p, oct(st.st_mode))
        assert st.st_uid == os.getuid() and st.st_gid == os.getgid(), (where, p, st.st_uid)
    modes = {name: oct(os.lstat(got / name).st_mode & 0o7777) for name in ("suid", "secret", "sub", "sub/sgid")}
    assert modes == {"suid": "0o755", "secret": "0o600", "sub": "0o755", "sub/sgid": "0o755"}, (where, modes)
