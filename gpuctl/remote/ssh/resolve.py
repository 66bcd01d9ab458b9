"""`--host` as the user's OpenSSH config sees it: an alias's HostName, User, Port, IdentityFile and
ProxyJump hops, read with paramiko's SSHConfig (the OpenSSH rules: first value wins, Host and
Match blocks, %-tokens). gpuctl resolves once, at `up`, and records the result, so later commands
do not depend on the config file any more.

The file is `remote.ssh_config`, else ~/.ssh/config where it exists (like `ssh -F`, no system-wide
file is read). `Include` lines are read in place (paramiko does not follow them).
"""

from __future__ import annotations

import glob
import io
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuctl.errors import ConfigError
from gpuctl.model.endpoint import Endpoint, split_target

_MAX_DEPTH = 8  # hops of hops: more is a loop in the config


def config_path(setting: str) -> Path | None:
    """The ssh config file to read: `remote.ssh_config` (which must exist), else ~/.ssh/config if present."""
    if setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ConfigError(f"remote.ssh_config names {path}, which {'is not a file' if path.exists() else 'does not exist'}",
                              "Point `remote.ssh_config` (GPUCTL_REMOTE__SSH_CONFIG) at your ssh config file, "
                              "or set it to \"\" for ~/.ssh/config.")
        return path
    path = Path("~/.ssh/config").expanduser()
    return path if path.is_file() else None


def _expanded(path: Path, depth: int = 0) -> str:
    """The file's text with each `Include` replaced by the files it names (relative: to ~/.ssh)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read the ssh config {path}: {exc.strerror or exc}") from None
    out = []
    for line in text.splitlines():
        words = line.strip().replace("=", " ", 1).split()
        if words and words[0].lower() == "include" and depth < 16:
            for pattern in words[1:]:
                pattern = os.path.expanduser(pattern.strip('"'))
                if not os.path.isabs(pattern):
                    pattern = os.path.join(os.path.expanduser("~/.ssh"), pattern)
                for inc in sorted(glob.glob(pattern)):
                    if os.path.isfile(inc):
                        out.append(_expanded(Path(inc), depth + 1))
        else:
            out.append(line)
    return "\n".join(out)


def load(path: Path | None) -> Any:
    """A parsed paramiko SSHConfig for `path` (None: an empty one)."""
    from paramiko import SSHConfig
    from paramiko.ssh_exception import ConfigParseError

    if path is None:
        return SSHConfig()
    try:
        return SSHConfig.from_file(io.StringIO(_expanded(path)))
    except ConfigParseError as exc:
        raise ConfigError(f"cannot read the ssh config {path}: {exc}", "Fix that line (see `man ssh_config`).") from None


def _host_of(text: str) -> str | None:
    try:
        return split_target(text)[1]
    except ValueError:
        return None  # reported when that hop is resolved


def _identity(files: list[str], host: str, source: Path | None) -> str:
    existing = [f for f in files if os.path.isfile(f)]
    if not existing:
        raise ConfigError(
            f"the IdentityFile for {host} in {source} does not exist: {', '.join(files)}",
            "Fix the IdentityFile line, create the key, or pass another with --identity.",
        )
    return existing[0]


def resolve(text: str, cfg: Any, source: Path | None = None, identity: str | None = None,
            default_user: str = "") -> Endpoint:
    """`[user@]host[:port]` or an alias, through `cfg` (from load(); `source` names its file in
    errors). What `text` says wins over the config, as with ssh; `identity` (--identity) wins over
    the host's IdentityFile, and is what a hop without an IdentityFile of its own logs in with.
    Raises ConfigError for what cannot work."""
    return _resolve(text, cfg, source, identity, identity, default_user, 0)


def _resolve(text: str, cfg: Any, source: Path | None, identity: str | None, fallback: str | None,
             default_user: str, depth: int) -> Endpoint:
    import getpass

    where = f" (a ProxyJump in {source})" if depth else ""
    if depth > _MAX_DEPTH:
        raise ConfigError(f"the ProxyJump hops in {source} go round in a loop (at {text})",
                          "Give the jump host its own `Host` block with `ProxyJump none`.")
    try:
        user, host, port = split_target(text)
    except ValueError as exc:
        raise ConfigError(f"{exc}{where}") from None
    opts = cfg.lookup(host)
    jumps = [h.strip() for h in (opts.get("proxyjump") or "none").split(",") if h.strip()]
    if jumps == ["none"] or (jumps and _host_of(jumps[0]) == host):
        jumps = []  # none, or a wildcard block naming the jump host itself (OpenSSH skips that too)
    if opts.get("proxycommand") and not jumps:
        raise ConfigError(f"{host} uses a ProxyCommand in {source}; gpuctl supports ProxyJump only",
                          "Write the hop as `ProxyJump user@bastion` (gpuctl then checks every hop's host key).")
    try:
        _, hostname, _ = split_target(opts.get("hostname") or host)
        port = port or int(opts.get("port", 22))
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise ConfigError(f"the HostName or Port for {host} in {source} is not usable: "
                          f"{opts.get('hostname')!r}, {opts.get('port')!r}") from None
    files = opts.get("identityfile") or []
    ident = identity or (_identity(files, host, source) if files else None) or fallback
    hops = [_resolve(h, cfg, source, None, fallback, default_user, depth + 1) for h in jumps]
    # As OpenSSH does: the first hop's own ProxyJump comes before it; later hops' are not used.
    jump = (*hops[0].jump, *(replace(h, jump=()) for h in hops)) if hops else ()
    return Endpoint(user=user or opts.get("user") or default_user or getpass.getuser(), host=hostname,
                    port=port, identity=ident, jump=jump, alias=host if hostname != host else "")
