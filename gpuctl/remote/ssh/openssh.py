"""The OpenSSH client's view of a host (rsync pushes and pulls, `gpuctl ssh`, `attach`, the
TensorBoard tunnel): a config file gpuctl writes under its home and passes with `-F`.

Why a file: OpenSSH applies `-o` options to the target only, never to ProxyJump hops, and reads
no other config once `-F` is given, so the file alone decides how every hop is reached and
checked: gpuctl's known_hosts, StrictHostKeyChecking yes, each hop's user, port and key. Hops are
chained with ProxyCommand lines gpuctl quotes itself (OpenSSH's own ProxyJump would hand `-F path`
to a shell unquoted, and gpuctl's home may hold a space, as macOS's Application Support does).
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
from pathlib import Path

from gpuctl.errors import ConfigError
from gpuctl.files import write_private
from gpuctl.model.endpoint import Endpoint
from gpuctl.remote.ssh.known_hosts import known_hosts_path

HOP = "gpuctl-jump-"  # the Host names of the hops inside the file; the target is everything else


def _path(value: str, what: str) -> str:
    """A path as an ssh_config argument: in double quotes (it may hold spaces), '%' doubled (these
    keywords expand %-tokens). Quotes, backslashes and line breaks cannot be written safely."""
    if any(c in value for c in '"\\\n\r'):
        raise ConfigError(f"{what} {value!r} holds a quote, backslash or line break, which OpenSSH cannot read",
                          "Move the file to a plain path.")
    return '"' + value.replace("%", "%%") + '"'


def _token(value: str) -> str:
    """A host or user name (checked by Endpoint's parser: no spaces or quotes) with '%' doubled."""
    return value.replace("%", "%%")


def _proxy_command(ssh: str, conf: Path, hop: int) -> str:
    """Reach `%h:%p` through hop number `hop`, which the same file describes."""
    quoted = [shlex.quote(ssh).replace("%", "%%"), "-F", shlex.quote(str(conf)).replace("%", "%%")]
    return " ".join([*quoted, "-W", "'[%h]:%p'", f"{HOP}{hop}"])


def _alias(ep: Endpoint) -> list[str]:
    return [f"    HostKeyAlias {_token(ep.key_alias)}"] if ep.key_alias else []


def _login(ep: Endpoint) -> list[str]:
    lines = [f"    User {_token(ep.user)}", f"    Port {ep.port}"]
    if ep.identity:
        lines += [f"    IdentityFile {_path(ep.identity, 'the key')}", "    IdentitiesOnly yes"]
    return lines


def render(ep: Endpoint, known_hosts: Path, conf: Path, ssh: str = "ssh") -> str:
    """The config text for `ep` (the file will live at `conf`)."""
    lines = ["# Written by gpuctl for one host and its jump hosts; rewritten as needed. Do not edit.", ""]
    for i, hop in enumerate(ep.jump):
        lines += [f"Host {HOP}{i}", f"    HostName {_token(hop.host)}", *_login(hop)]
        if i:
            lines.append(f"    ProxyCommand {_proxy_command(ssh, conf, i - 1)}")
        lines.append("")
    lines += [f"Host * !{HOP}*", *_login(ep), *_alias(ep)]
    if ep.jump:
        lines.append(f"    ProxyCommand {_proxy_command(ssh, conf, len(ep.jump) - 1)}")
    lines += [
        "",
        "Host *",
        f"    UserKnownHostsFile {_path(str(known_hosts), 'the gpuctl home')}",
        "    GlobalKnownHostsFile /dev/null",
        "    StrictHostKeyChecking yes",
        "    UpdateHostKeys no",
        "    BatchMode yes",
        "    ConnectTimeout 20",
        "",
    ]
    return "\n".join(lines)


def config_file(ep: Endpoint, home: Path) -> Path:
    """Write (once) and return the config file for `ep` under `home`/ssh. Its name comes from what
    it says, so concurrent commands never write different text to one file."""
    ssh = shutil.which("ssh") or "ssh"
    known = known_hosts_path(home)
    key = repr((ep.spec, ep.identity, [(h.spec, h.identity) for h in ep.jump], str(known), ssh))
    folder = home / "ssh"
    conf = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.conf"
    text = render(ep, known, conf, ssh)
    if not conf.exists() or conf.read_text() != text:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(conf, text)
    return conf


def host_block(alias: str, ep: Endpoint, home: Path) -> list[str]:
    """A `Host alias` block for the user's own ssh config (`gpuctl ssh-config`): plain `ssh alias`
    reaches the host the way gpuctl does, through the same jump hosts, every key checked strictly."""
    lines = [f"Host {alias}", f"    HostName {_token(ep.host)}", *_login(ep), *_alias(ep),
             f"    UserKnownHostsFile {_path(str(known_hosts_path(home)), 'the gpuctl home')}",
             "    GlobalKnownHostsFile /dev/null", "    StrictHostKeyChecking yes"]
    if ep.jump:
        conf = config_file(ep, home)  # the hops' Host blocks live there
        lines.append(f"    ProxyCommand {_proxy_command(shutil.which('ssh') or 'ssh', conf, len(ep.jump) - 1)}")
    return lines
