"""`--host` through the user's ssh config (paramiko's SSHConfig) and the OpenSSH config gpuctl writes
for rsync and `gpuctl ssh`, checked with `ssh -G` (OpenSSH's own reading of it, no network).

Bad inputs tried: a host that would be an ssh option (`-oProxyCommand=...`), spaces and quotes in
a host, a bad port, an IdentityFile that does not exist, `remote.ssh_config` naming a missing file
or a directory, an unparsable config line, a ProxyCommand, a ProxyJump loop, a malformed hop, a
key path with a quote."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpuctl.errors import ConfigError
from gpuctl.model.endpoint import Endpoint, split_target
from gpuctl.model.records import InstanceRecord
from gpuctl.remote.ssh import openssh
from gpuctl.remote.ssh import resolve as ssh_resolve


def cfg_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def resolve(path: Path, host: str, **kw) -> Endpoint:
    return ssh_resolve.resolve(host, ssh_resolve.load(path), path, **kw)


@pytest.mark.parametrize("text, want", [
    ("box", (None, "box", None)),
    ("root@10.0.0.1:2222", ("root", "10.0.0.1", 2222)),
    ("ssh://me@[fe80::1]:22", ("me", "fe80::1", 22)),
    ("a@b@host", ("a@b", "host", None)),
    ("::1", (None, "::1", None)),
])
def test_split_target(text, want):
    assert split_target(text) == want


@pytest.mark.parametrize("bad", ["-oProxyCommand=touch /tmp/x", "root@-oProxyCommand=x", "ho st", "h'ost",
                                 "root@host:0", "root@host:x", "root@", "[::1]x", "-x@host"])
def test_hosts_that_cannot_be_hosts_are_refused(bad):
    with pytest.raises(ValueError, match="not a host"):
        Endpoint.parse(bad)


def test_spec_round_trips_and_records_rebuild_the_endpoint():
    hop = Endpoint("u", "fe80::1", 2200, identity="/k")
    assert Endpoint.parse(hop.spec) == Endpoint("u", "fe80::1", 2200)
    rec = InstanceRecord(id="x", cluster="c", state="running", launched_at=0, workdir="/w", public_ip="10.0.0.5",
                         ssh_user="root", port=22, key_path="/key", jump_hosts=(hop.spec, "v@gw:22"), jump_keys=("/k",))
    ep = Endpoint.from_record(rec)
    assert ep == Endpoint("root", "10.0.0.5", 22, identity="/key", jump=(hop, Endpoint("v", "gw", 22)))


def test_alias_precedence_and_hops(tmp_path, monkeypatch):
    key = tmp_path / "id key"
    key.write_text("k")
    monkeypatch.setenv("HOME", str(tmp_path))
    path = cfg_file(tmp_path, f"""
        Host gpubox
            HostName 10.1.2.3
            User root
            Port 2222
            IdentityFile ~/missing_first
            IdentityFile "{key}"
            ProxyJump bastion,me@second:2200
        Host bastion
            HostName 192.0.2.9
            ProxyJump outer
        Host outer
            HostName 192.0.2.1
            User out
        Host *.lab
            ProxyJump gw.lab
    """)
    ep = resolve(path, "gpubox", default_user="local")
    assert (ep.user, ep.host, ep.port, ep.identity, ep.alias) == ("root", "10.1.2.3", 2222, str(key), "gpubox")
    # The first hop's own ProxyJump comes first; hops without IdentityFile get --identity (none here).
    assert [(h.user, h.host, h.port, h.identity) for h in ep.jump] == [
        ("out", "192.0.2.1", 22, None), ("local", "192.0.2.9", 22, None), ("me", "second", 2200, None)]
    assert ep.name == "gpubox (root@10.1.2.3:2222) via out@192.0.2.1:22, local@192.0.2.9:22, me@second:2200"
    # What --host says wins over the config; --identity wins over IdentityFile and is the hops' fallback.
    ep = resolve(path, "admin@gpubox:22", identity="/flag/key", default_user="local")
    assert (ep.user, ep.port, ep.identity) == ("admin", 22, "/flag/key")
    assert [h.identity for h in ep.jump] == ["/flag/key", "/flag/key", "/flag/key"]
    # Not an alias: left as it is (DNS decides later). A wildcard naming the jump host skips itself.
    assert resolve(path, "plain", default_user="u") == Endpoint("u", "plain", 22)
    assert [h.host for h in resolve(path, "x.lab").jump] == ["gw.lab"]


def test_include_is_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh" / "conf.d").mkdir(parents=True)
    (tmp_path / ".ssh" / "conf.d" / "lab.conf").write_text("Host gpubox\n  HostName 10.9.9.9\n  User lab\n")
    (tmp_path / ".ssh" / "config").write_text("Include conf.d/*.conf\n")
    path = ssh_resolve.config_path("")
    assert path == tmp_path / ".ssh" / "config"
    ep = resolve(path, "gpubox")
    assert (ep.user, ep.host) == ("lab", "10.9.9.9")


def test_no_config_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ssh_resolve.config_path("") is None
    assert ssh_resolve.resolve("root@box", ssh_resolve.load(None)) == Endpoint("root", "box", 22)


def test_bad_configs_are_config_errors_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"remote.ssh_config names {tmp_path}/nope, which does not exist"):
        ssh_resolve.config_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="is not a file"):
        ssh_resolve.config_path(str(tmp_path))
    path = cfg_file(tmp_path, "Host box\n  IdentityFile /no/such/key\n")
    with pytest.raises(ConfigError, match=f"IdentityFile for box in {path} does not exist: /no/such/key") as exc:
        resolve(path, "box")
    assert "--identity" in exc.value.hint
    with pytest.raises(ConfigError, match=f"cannot read the ssh config {path}"):
        resolve(cfg_file(tmp_path, "Host box\n  =broken\n"), "box")
    with pytest.raises(ConfigError, match="ProxyCommand"):
        resolve(cfg_file(tmp_path, "Host box\n  ProxyCommand nc %h %p\n"), "box")
    with pytest.raises(ConfigError, match="loop"):
        resolve(cfg_file(tmp_path, "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n"), "a")
    with pytest.raises(ConfigError, match="not a host.*a ProxyJump in"):
        resolve(cfg_file(tmp_path, "Host a\n  ProxyJump bad host name\n"), "a")
    with pytest.raises(ConfigError, match="HostName or Port for a"):
        resolve(cfg_file(tmp_path, "Host a\n  Port 99999\n"), "a")


def ssh_g(conf: Path, target: str) -> dict[str, str]:
    out = subprocess.run(["ssh", "-G", "-F", str(conf), target], capture_output=True, text=True, check=True).stdout
    return {k: v for k, _, v in (line.partition(" ") for line in out.splitlines())}


@pytest.mark.skipif(not shutil.which("ssh"), reason="needs the OpenSSH client")
def test_openssh_config_quotes_paths_and_applies_to_every_hop(tmp_path):
    home = tmp_path / "gpuctl home %h"  # a space and a %-token in the path: both must survive
    key = tmp_path / "my key"
    hop0, hop1 = Endpoint("j0", "192.0.2.1", 2200, identity=str(key)), Endpoint("j1", "192.0.2.2", 22)
    ep = Endpoint("root", "10.0.0.5", 22, identity=str(key), jump=(hop0, hop1))
    conf = openssh.config_file(ep, home)
    assert conf.parent == home / "ssh" and oct(conf.stat().st_mode & 0o777) == "0o600"
    assert openssh.config_file(ep, home) == conf  # same endpoint, same file
    known = str(home / "known_hosts")
    target = ssh_g(conf, "root@10.0.0.5")
    assert (target["user"], target["hostname"], target["port"], target["identityfile"]) == ("root", "10.0.0.5", "22", str(key))
    assert target["userknownhostsfile"] == known and target["stricthostkeychecking"] == "true"
    assert target["globalknownhostsfile"] == "/dev/null" and target["batchmode"] == "yes"
    assert target["proxycommand"].endswith("-W '[%h]:%p' gpuctl-jump-1")
    for alias, hop in ((f"{openssh.HOP}0", hop0), (f"{openssh.HOP}1", hop1)):
        seen = ssh_g(conf, alias)
        assert (seen["user"], seen["hostname"], seen["port"]) == (hop.user, hop.host, str(hop.port))
        assert seen["userknownhostsfile"] == known and seen["stricthostkeychecking"] == "true"
    assert ssh_g(conf, f"{openssh.HOP}1")["proxycommand"].endswith("gpuctl-jump-0")
    assert "proxycommand" not in ssh_g(conf, f"{openssh.HOP}0")
    # The ProxyCommand, as the shell will run it once ssh has expanded %% and the tokens.
    cmd = ssh_g(conf, "root@10.0.0.5")["proxycommand"].replace("%%", "%")
    import shlex

    words = shlex.split(cmd)
    assert words[1:3] == ["-F", str(conf)]
    with pytest.raises(ConfigError, match="quote"):
        openssh.config_file(Endpoint("r", "h", 22, identity='/a"b'), home)


def test_host_block_for_the_users_own_ssh(tmp_path):
    ep = Endpoint("root", "10.0.0.5", 22, identity="/k", jump=(Endpoint("j", "192.0.2.1", 22),))
    user_cfg = tmp_path / "config"
    user_cfg.write_text("\n".join(openssh.host_block("box", ep, tmp_path / "h")) + "\n")
    seen = ssh_g(user_cfg, "box")
    assert (seen["hostname"], seen["user"], seen["identityfile"]) == ("10.0.0.5", "root", "/k")
    assert seen["proxycommand"].endswith("gpuctl-jump-0") and seen["stricthostkeychecking"] == "true"
