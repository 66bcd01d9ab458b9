"""Where to SSH: an endpoint (`user@host:port`, its key, its jump hosts) and the parsing of what a
user types for one. Plain data: what settings, the providers and both SSH transports (Fabric:
remote/ssh/host.py, OpenSSH: remote/ssh/openssh.py) share; the pins of host keys are
remote/ssh/known_hosts.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gpuctl.model.records import InstanceRecord

# What a host name, and a login name, may hold: they reach ssh argv and ssh config files, so no
# spaces, quotes or a leading '-' (which ssh would read as an option).
_HOST = re.compile(r"[A-Za-z0-9_.:%-]+")
_USER = re.compile(r"[A-Za-z0-9_.@+-]+")


def split_target(text: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (IPv6 as `[::1]:22`, `ssh://` allowed) -> (user or None, host, port or None)."""
    rest = text.removeprefix("ssh://")
    user, _, rest = rest.rpartition("@")
    port: int | None = None
    try:
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            if tail:
                if not tail.startswith(":"):
                    raise ValueError
                port = int(tail[1:])
        elif rest.count(":") == 1:
            host, _, p = rest.partition(":")
            port = int(p)
        else:
            host = rest
    except ValueError:
        raise ValueError(f"not a host: {text!r} (expected user@host[:port])") from None
    if (not _HOST.fullmatch(host) or host.startswith("-") or (user and (not _USER.fullmatch(user) or user.startswith("-")))
            or not (port is None or 0 < port < 65536)):
        raise ValueError(f"not a host: {text!r} (expected user@host[:port])")
    return user or None, host, port


@dataclass(frozen=True)
class Endpoint:
    """Where to SSH: `user@host:port`, the key to log in with (None: ssh-agent and ~/.ssh keys),
    and the jump hosts on the way, the first one reached directly from here (ProxyJump order)."""

    user: str
    host: str
    port: int = 22
    identity: str | None = None
    jump: tuple[Endpoint, ...] = ()
    alias: str = ""  # the ssh config `Host` it was resolved from, for messages
    # The name its host key is pinned under (OpenSSH's HostKeyAlias), when not its address: a
    # cloud recycles public IPs, so an instance is pinned by its id and its pin dropped at `down`.
    key_alias: str = ""

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def spec(self) -> str:
        """`user@host:port`, as parse() reads it back (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"

    @property
    def name(self) -> str:
        """How messages name it: the alias the user typed, where it leads, and through which hops."""
        base = f"{self.alias} ({self.label})" if self.alias and self.alias != self.host else self.label
        return base + (" via " + ", ".join(h.label for h in self.jump) if self.jump else "")

    @classmethod
    def from_record(cls, instance: InstanceRecord) -> Endpoint:
        """Where an InstanceRecord says the machine is, with the jump hosts recorded at `up`."""
        keys = (*instance.jump_keys, *[""] * len(instance.jump_hosts))
        jump = tuple(replace(cls.parse(h), identity=k or None) for h, k in zip(instance.jump_hosts, keys))
        return cls(user=instance.ssh_user or "", host=instance.public_ip or "", port=instance.port or 22,
                   identity=instance.key_path, jump=jump)

    @classmethod
    def parse(cls, text: str, default_user: str = "") -> Endpoint:
        """`[user@]host[:port]`; IPv6 as `[::1]:22`. A bare name may be an ssh config alias."""
        import getpass

        user, host, port = split_target(text)
        return cls(user=user or default_user or getpass.getuser(), host=host, port=port or 22)
