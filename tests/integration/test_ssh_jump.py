"""A GPU box behind a bastion, reached through the user's ssh config (an alias with HostName, User,
Port, IdentityFile and ProxyJump), against real OpenSSH sshd test hosts (tests/sshd.py): the box
sits in its own network namespace wired only to the bastion's, and this machine rejects its
subnet, so every byte to it goes through the bastion.

The SSH layer is tested directly (SshHost, the ssh provider, the OpenSSH argv) and through the CLI.
Bad inputs tried: an alias in no config that DNS does not know (fails at once, naming it), a
bastion that does not answer (times out naming the bastion), a box that is down behind a live
bastion, a changed host key of the box and of the bastion (both refused, by paramiko and by
OpenSSH), an IdentityFile that does not exist, `remote.ssh_config` naming a missing file.
(tests/unit/test_ssh_resolve.py covers the config reading and the generated OpenSSH config.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpuctl.errors import ConfigError, RemoteError
from gpuctl.model.endpoint import Endpoint
from gpuctl.remote.ssh import resolve as ssh_resolve
from gpuctl.remote.ssh.host import SshHost
from gpuctl.remote.ssh.known_hosts import known_hosts_path
from tests import sshd
from tests.conftest import HOST_PYTHON, use_hosts


class JumpLab:
    def __init__(self, key: Path, bastion: sshd.TestHost, box: sshd.TestHost):
        self.key, self.bastion, self.box = key, bastion, box

    def ssh_config(self, path: Path, port: int = 22, identity: str | None = None) -> Path:
        """A user's ssh config: `gpubox` behind `bastion-alias`, both with the lab's key."""
        ident = identity or str(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"Host gpubox\n    HostName {self.box.ip}\n    User root\n    Port {port}\n"
            f'    IdentityFile "{ident}"\n    ProxyJump bastion-alias\n\n'
            f"Host bastion-alias\n    HostName {self.bastion.ip}\n    User root\n    IdentityFile {self.key}\n"
        )
        return path

    def accepted(self, host: sshd.TestHost) -> int:
        return (host.base / "sshd.log").read_text().count("Accepted publickey")


@pytest.fixture(scope="module")
def jump_lab():
    """A bastion (index 3, reachable from here) and a box behind it (index 4, reachable only from
    the bastion's namespace); namespaces destroyed at the end."""
    base, key, tag = sshd.prepare("jump-hosts")
    bastion = sshd.TestHost(3, base / "bastion", tag=tag)
    box = sshd.TestHost(4, base / "box", tag=tag, behind=bastion)
    made = []
    try:
        for h in (bastion, box):
            made.append(h)
            h.create(key.with_suffix(".pub").read_text())
            h.start()
        yield JumpLab(key, bastion, box)
    finally:
        for h in reversed(made):
            h.destroy()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def lab(jump_lab, monkeypatch):
    """Both hosts running with fresh work dirs; gpuctl's remote settings point at them."""
    use_hosts((jump_lab.bastion, jump_lab.box), monkeypatch)
    return jump_lab


def user_config(lab: JumpLab) -> Path:
    return lab.ssh_config(Path(os.environ["HOME"]) / ".ssh" / "config")


def connect(ep: Endpoint, home: Path, timeout: float = 15.0) -> SshHost:
    return SshHost(ep, home, None, sshd.WORKDIR, python=str(HOST_PYTHON), connect_timeout_s=timeout)


def resolved(alias: str = "gpubox", setting: str = "") -> Endpoint:
    path = ssh_resolve.config_path(setting)
    return ssh_resolve.resolve(alias, ssh_resolve.load(path), path)


# --- the layer itself ---------------------------------------------------------------------------


def test_the_box_is_reachable_only_through_the_bastion(lab):
    assert sshd.tcp_reachable(lab.bastion.ip, 22, 3)
    t0 = time.monotonic()
    assert not sshd.tcp_reachable(lab.box.ip, 22, 3)
    assert time.monotonic() - t0 < 2  # rejected here, not sent off by the default route
    probe = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{lab.box.ip}/22' && echo open"
    assert lab.bastion.run(probe).stdout.strip() == "open"


def test_alias_resolves_from_the_users_ssh_config(lab):
    user_config(lab)
    ep = resolved()
    assert (ep.user, ep.host, ep.port, ep.identity, ep.alias) == ("root", lab.box.ip, 22, str(lab.key), "gpubox")
    assert [(h.user, h.host, h.port, h.identity, h.alias) for h in ep.jump] == [
        ("root", lab.bastion.ip, 22, str(lab.key), "bastion-alias")]
    # What --host says wins over the config, as with ssh.
    ep = ssh_resolve.resolve("admin@gpubox:2200", ssh_resolve.load(ssh_resolve.config_path("")), None)
    assert (ep.user, ep.port) == ("admin", 2200) and ep.jump


def test_commands_files_and_pushes_through_the_jump(lab, isolated, make_project, tmp_path):
    user_config(lab)
    ep = resolved()
    bastion_logins, box_logins = lab.accepted(lab.bastion), lab.accepted(lab.box)
    host = connect(ep, isolated)
    try:
        assert host.run(["hostname", "-I"]).stdout.split() == [lab.box.ip]
        assert host.root == sshd.WORKDIR and host.label.startswith(f"gpubox (root@{lab.box.ip}:22) via root@")
        res = host.run(["sh", "-c", "cat; echo err >&2; exit 3"], check=False, stdin=b"in \x00 bytes")
        assert (res.returncode, res.stdout, res.stderr) == (3, "in \x00 bytes", "err\n")
        with pytest.raises(RemoteError, match="not installed"):
            host.run(["no-such-program-here"])
        with pytest.raises(RemoteError, match=r"failed on gpubox .*exit 1"):
            host.run(["false"])
        host.write_text(f"{sshd.WORKDIR}/a/b.txt", "it's here")
        assert host.read_bytes(f"{sshd.WORKDIR}/a/b.txt") == b"it's here"
        assert host.read_bytes(f"{sshd.WORKDIR}/nope") is None
        # A push: rsync over the OpenSSH client, through the same bastion, quoting intact.
        proj = make_project("jump 'proj' $(x)", {"train.py": "print(1)\n", "we ird 'q'.py": "x", "d/e.txt": "e"})
        stats = host.push(proj, f"{sshd.WORKDIR}/code/p")
        assert stats.files_copied == 3 and host.has_rsync is True
        assert lab.box.run(f"cat '{sshd.WORKDIR}/code/p/d/e.txt'").stdout == "e"
        assert host.push(proj, f"{sshd.WORKDIR}/code/p").files_copied == 0
        assert host.pull_tree(f"{sshd.WORKDIR}/code/p", tmp_path / "back") == (3, ())
        assert (tmp_path / "back" / "we ird 'q'.py").read_text() == "x"
        assert host.read_bytes(f"{sshd.WORKDIR}/code/p/train.py")
        # Last: a command past its deadline makes the host count as hung for the rest of the command.
        with pytest.raises(RemoteError, match="did not finish within 1 s"):
            host.run(["sleep", "5"], timeout=1)
        with pytest.raises(RemoteError, match="did not finish within 1 s"):
            host.run(["true"])
    finally:
        host.close()
    # One paramiko login to each, plus rsync's three OpenSSH logins (push, push, pull): each a
    # bastion login too. Never one per file or per command.
    assert lab.accepted(lab.box) - box_logins == 4
    assert lab.accepted(lab.bastion) - bastion_logins == 4
    # Both hops' keys pinned in gpuctl's known_hosts, not the user's.
    pinned = known_hosts_path(isolated).read_text()
    assert f"{lab.bastion.ip} ssh-ed25519" in pinned and f"{lab.box.ip} ssh-ed25519" in pinned
    assert not (Path(os.environ["HOME"]) / ".ssh" / "known_hosts").exists()


def test_a_connection_that_drops_mid_command_is_an_error_not_an_exit_code(lab, isolated):
    """paramiko answers -1 for a channel that closed without an exit status. A command killed by a
    signal does that (sshd sends exit-signal, which paramiko ignores): its own end. A connection
    gone does too, and its -1 read as the command's answer ("no such tmux session") once called a
    run lost and stopped its other nodes: that is an error. (The bastion, reached directly: a box
    behind it whose login is cut leaves paramiko's own thread a traceback as it closes the channel
    that carried it, noise this test would print.)"""
    import threading

    user_config(lab)
    host = connect(resolved("bastion-alias"), isolated)
    try:
        assert host.run(["sh", "-c", "kill -KILL $$"], check=False).returncode == -1
        # sshd ends this login while a command runs (the machine went, a NAT forgot it): the
        # listener's children, this login's sshd, and no other process on this machine.
        cut = threading.Timer(1.0, lambda: subprocess.run(["pkill", "-KILL", "-P", str(lab.bastion.proc.pid)]))
        cut.start()
        try:
            with pytest.raises(RemoteError, match="lost the connection"):
                host.run(["sleep", "20"], check=False)
        finally:
            cut.join()
    finally:
        host.close()


def test_openssh_argv_goes_through_the_jump_with_strict_keys(lab, tmp_path, monkeypatch):
    # A gpuctl home with a space and a '%' in it: the generated config must quote and escape both.
    home = tmp_path / "gpuctl home %h"
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    user_config(lab)
    ep = resolved()
    host = connect(ep, home)
    try:
        argv = host.ssh_argv("-T", f"{ep.user}@{ep.host}", "echo hi; hostname -I")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["hi", lab.box.ip]
        assert "StrictHostKeyChecking=yes" in argv and "-F" in argv
    finally:
        host.close()
    # The block `gpuctl ssh-config` can give the user's own ssh: plain `ssh box` takes the same path.
    from gpuctl.remote.ssh.openssh import host_block

    user_cfg = tmp_path / "user ssh config"
    user_cfg.write_text("\n".join(host_block("box", ep, home)) + "\n")
    res = subprocess.run(["ssh", "-F", str(user_cfg), "box", "hostname -I"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.split() == [lab.box.ip], res.stderr
    # The OpenSSH client reads gpuctl's known_hosts only: with the bastion's key gone from it, it
    # refuses (StrictHostKeyChecking yes applies to the jump host too, not only to the box).
    kh = known_hosts_path(home)
    kh.write_text("".join(ln for ln in kh.read_text().splitlines(True) if not ln.startswith(lab.bastion.ip + " ")))
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 255 and "Host key verification failed" in res.stderr


def test_ssh_provider_records_the_resolved_endpoint(lab, isolated):
    from gpuctl.model.specs import RemoteSpec, SshSpec
    from gpuctl.provision.ssh import SshProvider

    user_config(lab)
    remote = RemoteSpec(workdir=sshd.WORKDIR, python=str(HOST_PYTHON), connect_timeout_s=15)
    spec = SshSpec(name="jbox", instance_type="ssh", hosts=("gpubox",), remote=remote)
    provider = SshProvider(isolated, spec)
    [rec] = provider.launch()
    assert (rec.public_ip, rec.ssh_user, rec.port, rec.key_path) == (lab.box.ip, "root", 22, str(lab.key))
    assert rec.jump_hosts == (f"root@{lab.bastion.ip}:22",) and rec.jump_keys == (str(lab.key),)
    # Later commands use the record: the ssh config may be gone by then.
    (Path(os.environ["HOME"]) / ".ssh" / "config").unlink()
    host = provider.host(rec)
    try:
        assert host.run(["hostname", "-I"]).stdout.split() == [lab.box.ip]
    finally:
        host.close()


def test_changed_host_keys_behind_and_of_the_bastion_are_refused(lab, isolated):
    user_config(lab)
    ep = resolved()
    connect(ep, isolated).close()  # pins both keys
    # (The module's later tests use fresh gpuctl homes: the new keys are pinned there afresh.)
    # The box behind the jump first, then the jump host itself: both paths refuse each.
    for host, named in ((lab.box, rf"gpubox \(root@{lab.box.ip}:22\) via .*"),
                        (lab.bastion, rf"jump host root@{lab.bastion.ip}:22 .*")):
        host.new_host_key()
        host.restart()
        with pytest.raises(RemoteError, match=rf"host key of {named} has CHANGED"):
            connect(ep, isolated)
        res = _openssh(ep, isolated)
        assert res.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in res.stderr
        assert host.ip in res.stderr


def _openssh(ep: Endpoint, home: Path) -> subprocess.CompletedProcess:
    from gpuctl.remote.ssh.openssh import config_file

    argv = ["ssh", "-F", str(config_file(ep, home)), "-T", f"{ep.user}@{ep.host}", "true"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


# --- bad inputs, at the layer -------------------------------------------------------------------


def test_an_alias_nobody_knows_fails_at_once_naming_it(lab, isolated):
    user_config(lab)
    ep = resolved("gpubx-typo")
    assert ep.host == "gpubx-typo" and not ep.jump
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="cannot resolve 'gpubx-typo'") as exc:
        connect(ep, isolated, timeout=120)
    assert time.monotonic() - t0 < 10  # DNS saying no is final: no 120 s of retries
    assert "ssh config" in exc.value.hint


def test_a_bastion_that_does_not_answer_times_out_naming_it(lab, isolated):
    user_config(lab)
    ep = resolved()
    lab.bastion.unreachable()
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=rf"cannot connect to jump host root@{lab.bastion.ip}:22 on the way to "
                                              rf"root@{lab.box.ip}:22: timed out after 3s"):
            connect(ep, isolated, timeout=3)
        assert time.monotonic() - t0 < 20
    finally:
        lab.bastion.restart()


def test_a_box_down_behind_a_live_bastion_times_out_saying_so(lab, isolated):
    user_config(lab)
    ep = resolved()
    lab.box.stop()
    try:
        with pytest.raises(RemoteError, match=rf"cannot connect to gpubox .* timed out after 3s "
                                              rf"\(jump host root@{lab.bastion.ip}:22 could not reach {lab.box.ip}:22"):
            connect(ep, isolated, timeout=3)
    finally:
        lab.box.restart()


def test_missing_identity_file_and_missing_config_file(lab, tmp_path):
    lab.ssh_config(Path(os.environ["HOME"]) / ".ssh" / "config", identity=str(tmp_path / "no_such_key"))
    with pytest.raises(ConfigError, match=rf"IdentityFile for gpubox in .*config does not exist: {tmp_path}/no_such_key"):
        resolved()
    with pytest.raises(ConfigError, match=rf"remote.ssh_config names {tmp_path}/nope, which does not exist"):
        ssh_resolve.config_path(str(tmp_path / "nope"))


# --- through the CLI ----------------------------------------------------------------------------


def _loop(gpuctl, project, name: str, *hosts: str, extra=()):
    args = ["up", "--provider", "ssh", "--name", name, *extra]
    for h in hosts:
        args += ["--host", h]
    out = gpuctl(*args).stderr
    assert "gpubox (root@" in out and "reachable, host key pinned" in out
    res = gpuctl("train", project, "--allow-cpu", "--wait", "--", "--epochs", "2")
    assert "done" in res.stdout
    run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run["state"] == "succeeded" and run["epoch"] == 2
    assert "done" in gpuctl("logs", run["run_id"]).stdout
    return run


def test_whole_loop_through_the_bastion_with_the_users_ssh_config(gpuctl, lab, quick_project, capfd):
    user_config(lab)
    run = _loop(gpuctl, quick_project, "jbox", "gpubox")
    assert lab.box.run(f"cat {sshd.WORKDIR}/jbox/runs/{run['run_id']}/exitcode").stdout.strip() == "0"
    capfd.readouterr()
    # `gpuctl ssh` runs the OpenSSH client (its output goes straight to the terminal's fd).
    assert gpuctl("ssh", "--", "echo", "hi", "from", "$(hostname -I)").exit_code == 0
    assert capfd.readouterr().out.split() == ["hi", "from", lab.box.ip]
    gpuctl("down", "-y")
    assert sshd.gpuctl_servers(lab.box) == []


def test_whole_loop_with_remote_ssh_config_elsewhere(gpuctl, lab, quick_project, tmp_path, monkeypatch):
    cfg = lab.ssh_config(tmp_path / "lab configs" / "ssh config")
    monkeypatch.setenv("GPUCTL_REMOTE__SSH_CONFIG", str(cfg))
    assert not (Path(os.environ["HOME"]) / ".ssh" / "config").exists()
    _loop(gpuctl, quick_project, "jbox2", "gpubox")
    cfg.unlink()  # recorded at `up`: down does not need it
    gpuctl("down", "-y")


def test_cli_bad_inputs(gpuctl, lab, tmp_path, monkeypatch):
    user_config(lab)
    res = gpuctl("up", "--provider", "ssh", "--host", "gpubx-typo", code=7)
    assert "cannot resolve 'gpubx-typo'" in res.stderr
    other = lab.ssh_config(tmp_path / "other config", identity=str(tmp_path / "gone key"))
    monkeypatch.setenv("GPUCTL_REMOTE__SSH_CONFIG", str(other))
    res = gpuctl("up", "--provider", "ssh", "--host", "gpubox", code=3)
    assert f"the IdentityFile for gpubox in {other} does not exist: {tmp_path / 'gone key'}" in res.stderr
    monkeypatch.setenv("GPUCTL_REMOTE__SSH_CONFIG", str(tmp_path / "missing config"))
    res = gpuctl("up", "--provider", "ssh", "--host", "gpubox", code=3)
    assert f"remote.ssh_config names {tmp_path / 'missing config'}" in res.stderr
