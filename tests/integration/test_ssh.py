"""The ssh provider and SshHost against real OpenSSH sshd test hosts (tests/sshd.py): one network
namespace each, own IP, own tmux socket directory and own /srv (gpuctl's work dir, a tmpfs).

Bad inputs tried: an unreachable host (timeout naming host and port), a refused client key, a
changed host key, a full disk during a push, a host without tmux, a host without python3, a
host whose Python has no TensorFlow, and a malformed --host."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time

import pytest

from tests.conftest import REPO
from tests.integration.test_payload_tf import MODEL
from tests.sshd import ROOT, gpuctl_servers, gpuctl_tmux
from tests.waits import wait_for

TF_TRAIN = textwrap.dedent(MODEL) + textwrap.dedent("""
    import os, sys
    model.fit(x, y, batch_size=16, epochs=int(sys.argv[sys.argv.index("--epochs") + 1]), verbose=2)
    with open(os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "model.txt"), "w") as fh:
        fh.write("weights")
    print("data dir:", os.listdir(os.environ.get("GPUCTL_DATA_DIR", ".")))
""")


def up_ssh(gpuctl, lab, *hosts, name="box", code=0, extra=()):
    hosts = hosts or (lab.hosts[0],)
    args = ["up", "--provider", "ssh", "--name", name, "--identity", str(lab.key), *extra]
    for h in hosts:
        args += ["--host", h.address]
    return gpuctl(*args, code=code)


@pytest.mark.tf  # the one whole loop over ssh with real Keras
def test_whole_loop_over_ssh_with_the_real_tf_payload(gpuctl, ssh, make_project, tmp_path):
    host = ssh.hosts[0]
    out = up_ssh(gpuctl, ssh).stderr
    assert f"{host.address}:22: reachable, host key pinned" in out
    # `up` started the preflight in the background: the first train finds it kept.
    wait_for(lambda: host.run("ls /srv/gpuctl/_preflight/*.json").stdout.strip(), 120, "up's preflight")
    proj = make_project("tiny tf 'proj'", {"train.py": TF_TRAIN})
    data = tmp_path / "my data"
    data.mkdir()
    (data / "shard-0.bin").write_bytes(b"\0" * 1000)
    res = gpuctl("train", proj, "--data", data, "--allow-cpu", "--wait", "--", "--epochs", "2")
    assert "preflight on root@" in res.stderr and "TensorFlow 2." in res.stderr
    assert "kept from an earlier check" in res.stderr
    assert "data dir: ['shard-0.bin']" in res.stdout
    # TensorFlow's C++ start-up chatter stays in the log but off the terminal.
    assert "oneDNN custom operations" not in res.stdout and "absl::InitializeLog" not in res.stdout
    run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run["state"] == "succeeded" and run["epoch"] == 2 and run["epochs_planned"] == 2
    cost = json.loads(gpuctl("cost", "--json").stdout)["runs"][0]
    assert [e["epoch"] for e in cost["epochs"]] == [1, 2] and all(e["examples_per_s"] > 0 for e in cost["epochs"])
    assert "Epoch 2/2" in gpuctl("logs", run["run_id"]).stdout
    # --raw keeps it (which lines TensorFlow prints depends on the CPU; absl's notice comes with any).
    assert "absl::InitializeLog" in gpuctl("logs", "--raw", run["run_id"]).stdout
    # The job really ran on the host: its files are in the host's own /srv.
    assert host.run(f"cat {ROOT}/runs/{run['run_id']}/exitcode").stdout.strip() == "0"
    # Preflight once per environment: the next train reuses the answer, without
    # importing TensorFlow there; --recheck looks again. A plain script never imports TensorFlow.
    quick = make_project("quick", {"train.py": "import sys\nprint('tf imported:', 'tensorflow' in sys.modules)\n"})
    again = gpuctl("train", quick, "--allow-cpu", "--wait")
    assert "TensorFlow 2." in again.stderr and "kept from an earlier check" in again.stderr
    assert "tf imported: False" in again.stdout
    rechecked = gpuctl("train", quick, "--allow-cpu", "--recheck", "--wait").stderr
    assert "TensorFlow 2." in rechecked and "kept from an earlier check" not in rechecked
    pulled = gpuctl("pull", run["run_id"], "--dest", tmp_path / "back").stdout
    assert "Pulled" in pulled
    assert (tmp_path / "back" / run["run_id"] / "outputs" / "model.txt").read_text() == "weights"
    gpuctl("down", "-y")
    assert "Epoch 2/2" in gpuctl("logs", run["run_id"]).stdout  # kept after down
    assert gpuctl_servers(host) == []  # gpuctl's jobs are gone from the host


def test_incremental_push_and_quoting_over_ssh(gpuctl, ssh, make_project):
    up_ssh(gpuctl, ssh)
    files = {f"pkg/mod_{i}.py": f"X = {i}\n" for i in range(200)}
    files["we ird $(touch pwned) `x` 'q' ünï.py"] = "print('odd name ok')\n"
    files["train.py"] = "import sys\nprint('ARGS', sys.argv[1:])\nexec(open(\"we ird $(touch pwned) `x` 'q' ünï.py\").read())\n"
    proj = make_project("quote 'me' $(x)", files)
    first = json.loads(gpuctl("sync", proj, "--json").stdout)["code"]
    assert first["files_copied"] == 202
    noop = json.loads(gpuctl("sync", proj, "--json").stdout)["code"]
    assert noop["files_copied"] == 0 and noop["bytes_copied"] < first["bytes_copied"] / 3
    (proj / "pkg" / "mod_7.py").write_text("X = 'seven'\n")
    one = json.loads(gpuctl("sync", proj, "--json").stdout)["code"]
    assert one["files_copied"] == 1
    (proj / "pkg" / "mod_8.py").unlink()
    gone = json.loads(gpuctl("sync", proj, "--json").stdout)["code"]
    assert gone["files_deleted"] == 1
    nasty = ["a b", "$(touch pwned2)", "`touch pwned3`", "it's", "ünï"]
    res = gpuctl("train", proj, "--allow-cpu", "--wait", "--", *nasty)
    assert f"ARGS {nasty!r}" in res.stdout and "odd name ok" in res.stdout
    # Where an injected `touch` would land: the commands' working dirs (the work dir, the project's
    # copy), the homes, /tmp, and this checkout (a local shell's cwd). Not `find /`: the whole disk
    # of a developer's machine took minutes.
    found = ssh.hosts[0].run(f"find /srv /tmp /var/tmp -maxdepth 8 -name 'pwned*' 2>/dev/null; "
                             f"find {REPO} /root -maxdepth 2 -name 'pwned*' 2>/dev/null").stdout
    assert found.strip() == ""


def test_tar_fallback_when_the_host_has_no_rsync(gpuctl, ssh, make_project):
    ssh.hosts[0].restart(hidden=("/usr/bin/rsync",))
    up_ssh(gpuctl, ssh)
    proj = make_project("norsync", {"train.py": "print('hi')\n", "a/b.txt": "b"})
    first = json.loads(gpuctl("sync", proj, "--json").stdout)["code"]
    assert first["files_copied"] == 2
    assert json.loads(gpuctl("sync", proj, "--json").stdout)["code"]["files_copied"] == 0
    assert ssh.hosts[0].run(f"cat {ROOT}/code/norsync-*/a/b.txt").stdout == "b"


def test_one_connection_per_command_not_per_file(gpuctl, ssh, make_project):
    up_ssh(gpuctl, ssh)
    proj = make_project("many", {f"f{i}.txt": str(i) for i in range(300)} | {"train.py": "pass\n"})
    log = ssh.hosts[0].base / "sshd.log"
    before = log.read_text().count("Accepted publickey")
    gpuctl("sync", proj)
    # One paramiko connection, plus one for rsync: never one per file.
    assert log.read_text().count("Accepted publickey") - before <= 2


def test_an_ssh_host_can_be_used_again_after_down(gpuctl, ssh, quick_project):
    """`up`, `down`, `up` of the same host said "cluster has no instance" (the instance
    row, keyed by host, stayed with the first cluster). Each cluster has its own now, and each
    keeps its own report."""
    for _ in range(2):
        up_ssh(gpuctl, ssh, extra=("--usd-per-hour", "1"))
        gpuctl("train", quick_project, "--allow-cpu", "--wait")
        gpuctl("down", "-y")
    report = json.loads(gpuctl("cost", "--json").stdout)
    assert [c["name"] for c in report["clusters"]] == ["box", "box"]
    assert len({c["id"] for c in report["clusters"]}) == 2 and all(c["usd"] > 0 for c in report["clusters"])
    assert [r["epochs_done"] for r in report["runs"]] == [2, 2]
    assert "done" in gpuctl("logs", report["runs"][0]["run_id"]).stdout


def test_exec_fans_out_over_every_host(gpuctl, ssh):
    up_ssh(gpuctl, ssh, *ssh.hosts)
    results = json.loads(gpuctl("exec", "--json", "--", "sh", "-c", "hostname -I").stdout)
    assert sorted(r["stdout"].strip() for r in results) == sorted(h.ip for h in ssh.hosts)
    assert all(r["returncode"] == 0 for r in results)
    failing = gpuctl("exec", "--", "false", code=1)
    assert failing.exit_code == 1
    # The worst host's status also with --json (it was 0 when every host said 127).
    gpuctl("exec", "--json", "--", "no-such-program-here", code=127)


def test_ssh_config_makes_plain_ssh_work(gpuctl, ssh, isolated):
    up_ssh(gpuctl, ssh)
    out = gpuctl("ssh-config", "--install").stdout
    assert "Wrote" in out and "box" in out
    user_cfg = isolated.parent / "user" / ".ssh" / "config"
    assert user_cfg.read_text().startswith(f"Include {isolated / 'ssh_config'}")
    res = subprocess.run(["ssh", "-F", str(user_cfg), "-o", "BatchMode=yes", "box", "hostname -I"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ssh.hosts[0].ip
    gpuctl("ssh-config", "--install")  # again: the Include line is not added twice
    assert user_cfg.read_text().count("Include") == 1
    assert gpuctl("ssh", "--", "cat", "/proc/net/fib_trie").exit_code == 0


def test_attach_command_targets_the_runs_session(gpuctl, ssh, make_project):
    up_ssh(gpuctl, ssh)
    proj = make_project("sleepy", {"train.py": "import time\ntime.sleep(30)\n"})
    run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json").stdout)["run"]["run_id"]
    argv = gpuctl("attach", run_id, "--print").stdout
    tmux = gpuctl_tmux(ssh.hosts[0])
    assert f"{tmux} attach-session -t ={run_id}" in argv and "StrictHostKeyChecking=yes" in argv
    assert ssh.hosts[0].run(f"{tmux} has-session -t ={run_id}").returncode == 0
    gpuctl("down", "-y")


def test_tensorboard_is_forwarded_to_localhost_and_answers_this_user_only(gpuctl, ssh):
    from tests.integration.test_secrets_tensorboard import as_nobody, owner_gets_the_page

    up_ssh(gpuctl, ssh)
    host = ssh.hosts[0]
    proc = subprocess.Popen([str(REPO / ".venv/bin/gpuctl"), "tensorboard", "--port", "16006"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once TensorBoard serves on the host
        assert "http://127.0.0.1:16006/?token=" in line, line + (proc.stderr.read() if proc.poll() is not None else
                                                                  host.run(f"tail -20 {ROOT}/tensorboard/output.log").stdout)
        url = line.split()[1]
        def served() -> bool:
            try:
                owner_gets_the_page(url)
                return True
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                return False

        wait_for(served, 30, "the page through the tunnel")  # the tunnel opens a moment after the line
        # Another user of this machine on the forwarded port, and one of the host on its own port:
        # TensorBoard has no authentication of its own, the token check in front of it does.
        assert as_nobody(16006).split()[1:2] == ["403"], as_nobody(16006)
        on_host = ["nsenter", "-t", str(host.proc.pid), "-m", "-n"]
        assert as_nobody(6006, netns=on_host).split()[1:2] == ["403"], as_nobody(6006, netns=on_host)
        assert host.run(f"runuser -u nobody -- cat {ROOT}/tensorboard/token").returncode != 0
    finally:
        proc.terminate()
        proc.wait(10)
    # Its `ssh -N -L` child ends with it (it outlived a SIGTERM of gpuctl, holding the port).
    wait_for(lambda: not _forwarders(16006), 10, "the forwarder's end")
    # On the host it listens on 127.0.0.1 only: nothing is opened to the network.
    listening = host.run("cat /proc/net/tcp").stdout
    assert "0100007F:1776" in listening  # 127.0.0.1:6006
    assert "00000000:1776" not in listening


def _forwarders(port: int) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"127.0.0.1:{port}:127.0.0.1"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " -N " in line]


# --- bad inputs ---------------------------------------------------------------------------------


def test_tensorboard_refuses_a_local_port_in_use(gpuctl, ssh):
    import socket

    up_ssh(gpuctl, ssh)
    with socket.socket() as taken:  # someone else's server on that port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = gpuctl("tensorboard", "--port", str(port), code=5)
    assert f"port {port} is in use on this machine" in error_line(res)
    assert "--port" in res.stderr and "http://" not in res.stdout
    assert not _forwarders(port)


def error_line(res):
    return next(line for line in res.stderr.splitlines() if line.startswith("Error:"))


def test_unreachable_host_times_out_naming_host_and_port(gpuctl, ssh, monkeypatch):
    monkeypatch.setenv("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "3")
    ssh.hosts[1].unreachable()
    t0 = time.monotonic()
    res = up_ssh(gpuctl, ssh, ssh.hosts[1], code=7)
    assert time.monotonic() - t0 < 30
    assert f"cannot connect to {ssh.hosts[1].address}:22: timed out after 3s" in error_line(res)
    # Nothing was created on the host, so nothing is left in the ledger either.
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_refused_key(gpuctl, ssh, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    res = gpuctl("up", "--provider", "ssh", "--host", ssh.hosts[0].address, "--identity", str(other), code=7)
    assert f"{ssh.hosts[0].address}:22 refused the key {other}" in error_line(res)
    assert "--identity" in res.stderr


def test_changed_host_key_is_refused(gpuctl, ssh):
    up_ssh(gpuctl, ssh)
    host = ssh.hosts[0]
    host.new_host_key()
    host.restart()
    res = gpuctl("exec", "--", "true", code=7)
    assert f"the host key of {host.address}:22 has CHANGED" in error_line(res)
    assert "known_hosts" in res.stderr
    # `down` still closes the cluster here, but says plainly that it could not reach the host.
    down = gpuctl("down", "-y")
    assert "not reachable, its gpuctl jobs may still run" in down.stderr and "CHANGED" in down.stderr


def test_disk_full_during_a_push_keeps_the_previous_tree(gpuctl, ssh, make_project):
    ssh.hosts[0].restart(srv_size="1m")
    up_ssh(gpuctl, ssh)
    proj = make_project("fills", {"train.py": "print('v1')\n", "lib.py": "V = 1\n"})
    gpuctl("sync", proj)
    (proj / "lib.py").write_text("V = 2\n")
    (proj / "big.bin").write_bytes(b"x" * 3_000_000)
    res = gpuctl("sync", proj, code=7)
    assert "No space left on device" in error_line(res) and "disk is full" in res.stderr
    host = ssh.hosts[0]
    tree = host.run(f"ls -d {ROOT}/code/fills-*").stdout.strip()  # its place: name-ID
    import base64

    from gpuctl.remote.sync import decode_manifest

    manifest = decode_manifest(base64.b64decode(host.run(f"base64 -w0 {ROOT}/code/.fills-*.gpuctl-manifest").stdout))
    assert sorted(manifest) == ["lib.py", "train.py"]  # the previous push's record stands
    assert host.run(f"cat {tree}/train.py").stdout == "print('v1')\n"
    assert host.run(f"cat {tree}/lib.py").stdout in ("V = 1\n", "V = 2\n")  # whole, old or new
    assert host.run(f"ls -a {tree}").stdout.split().count("big.bin") == 0  # no half file


def _session_path_of(lab, host, program):
    """Where a login over SSH finds `program` (root's shell startup files may add to PATH)."""
    res = subprocess.run(["ssh", "-i", str(lab.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                          "-o", "BatchMode=yes", host.address, f"command -v {program}; which -a {program}"],
                         capture_output=True, text=True, timeout=30)
    return tuple(sorted({p for p in res.stdout.split() if p.startswith("/")}))


@pytest.mark.parametrize("program", ["tmux", "python3"])
def test_missing_tools_say_what_to_install(gpuctl, ssh, program):
    host = ssh.hosts[0]
    hide = _session_path_of(ssh, host, program)
    assert hide, f"{program} not found on the test host to begin with"
    host.restart(hidden=hide)
    res = up_ssh(gpuctl, ssh, code=7)
    assert f"{program} missing on {host.address}:22" in error_line(res)
    assert f"apt-get install {program}" in res.stderr


def test_no_tensorflow_on_the_host_is_refused(gpuctl, ssh, make_project, monkeypatch):
    # remote.python is used as it is (no setup step): one without TensorFlow is refused at train.
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/usr/bin/python3")
    up_ssh(gpuctl, ssh)
    proj = make_project("p", {"train.py": "print(1)\n"})
    res = gpuctl("train", proj, code=7)
    assert "TensorFlow is not usable by /" in error_line(res) and "No module named 'tensorflow'" in error_line(res)
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []


def test_malformed_host_is_a_config_error(gpuctl, ssh):
    res = gpuctl("up", "--provider", "ssh", "--host", "root@host:99999", code=3)
    assert "ssh.hosts" in error_line(res)
    res = gpuctl("up", "--provider", "ssh", code=3)
    assert "needs at least one host" in error_line(res)


def test_a_lab_torn_down_leaves_the_others_their_services_address(ssh, imds):
    """The node lab (test_multinode) ends before the spot tests run on the session's hosts: its
    teardown once removed the address every lab reaches IMDS and moto at, and the spot tests that
    came after it never heard their notices (CI failed on them, in suite order only)."""
    from tests import sshd

    host = ssh.hosts[0]
    ask = (f"python3 -c \"import urllib.request as u; print(u.urlopen(u.Request('{imds.url(host)}/latest/api/token', "
           f"method='PUT', headers={{'X-aws-ec2-metadata-token-ttl-seconds': '60'}}), timeout=5).status)\"")
    assert host.run(ask).stdout.strip() == "200"
    with sshd.running_lab("short-lived", {9: "x9"}) as (_, (other,)):
        assert other.run(ask.replace(host.services_ip, other.services_ip)).stdout.strip() == "200"
    result = host.run(ask)
    assert result.stdout.strip() == "200", result.stderr[-300:]


def test_train_to_a_host_ssh_cannot_reach_yet_says_it_waits(gpuctl, ssh, quick_project):
    # It waited connect_timeout_s (120 s by default) without a word.
    up_ssh(gpuctl, ssh)  # remote.connect_timeout_s = 15 (the fixture's), recorded with the cluster
    ssh.hosts[0].unreachable()
    try:
        res = gpuctl("train", quick_project, "--allow-cpu", code=7)
    finally:
        ssh.hosts[0].restart()
    waits = [line for line in res.stderr.splitlines() if f"waiting for SSH on {ssh.hosts[0].address}" in line]
    assert waits and " of 15 s" in waits[0], res.stderr
    assert len(waits) <= 3  # said every ~10 s, not at every retry
    assert "timed out after 15s" in error_line(res)


def test_a_changed_host_key_on_another_port_names_the_pinned_line(gpuctl, ssh, isolated):
    """On port 2222 the hint said "delete its line (10.0.0.3)" while the
    pinned line is `[10.0.0.3]:2222`, which is what the user must find and delete."""
    host = ssh.hosts[0]
    host.extra_config = ["Port 2222"]
    try:
        host.restart()
        gpuctl("up", "--provider", "ssh", "--name", "box", "--identity", str(ssh.key), "--host", f"{host.address}:2222")
        pinned = f"[{host.ip}]:2222"
        assert any(line.startswith(pinned + " ") for line in (isolated / "known_hosts").read_text().splitlines())
        host.new_host_key()
        host.restart()
        res = gpuctl("exec", "--", "true", code=7)
        assert f"delete its line ({pinned})" in res.stderr, res.stderr
    finally:
        host.extra_config = []
        host.restart()

