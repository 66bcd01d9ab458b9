"""Opening a host's SSH connection as Fabric `Connection`s: the jump hosts first (each one's
channel carries the next, Fabric's gateway), then the host, with backoff while it boots.

Every hop's host key is checked against gpuctl's own known_hosts, never the user's or the
system's: the first contact pins a key, a changed key is refused. Fabric's own defaults would
accept any key (AutoAddPolicy) and resolve hops from ssh config files again; here everything is
already resolved (gpuctl.remote.ssh.resolve), so each Connection gets an empty ssh config and
exactly the user, port and key it was given.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from gpuctl.errors import RemoteError
from gpuctl.model.endpoint import Endpoint
from gpuctl.remote.ssh.known_hosts import known_hosts_path
from gpuctl.retry import TimedOut, poll


def _pin_policy(path: Path, alias: str = "") -> Any:
    import paramiko

    class PinOnFirstContact(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]  # paramiko: no types
        """Trust a host's key the first time and remember it (under its key alias, if it has one);
        paramiko refuses a changed one."""

        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(f"{alias or hostname} {key.get_name()} {key.get_base64()}\n")
            os.chmod(path, 0o600)

    return PinOnFirstContact()


def pinned_name(ep: Endpoint) -> str:
    """The name the host's key is pinned under in known_hosts: its key alias, else its address as
    OpenSSH and paramiko write it (`[host]:port` off port 22)."""
    return ep.key_alias or (ep.host if ep.port == 22 else f"[{ep.host}]:{ep.port}")


def _connection(ep: Endpoint, known: Path, gateway: Any) -> Any:
    """A Fabric Connection to `ep` (not yet open) whose client trusts gpuctl's known_hosts only."""
    from fabric import Config, Connection
    from paramiko import SSHConfig

    # An explicit, empty SSHConfig: Fabric reads no ssh config file; lazy: no ~/.fabric.yaml either.
    config = Config(ssh_config=SSHConfig(), lazy=True)
    conn = Connection(
        ep.host, user=ep.user, port=ep.port, config=config, gateway=gateway or False,
        connect_kwargs={"key_filename": [ep.identity] if ep.identity else [],
                        "look_for_keys": ep.identity is None, "allow_agent": ep.identity is None},
    )
    client = conn.client  # Fabric's: AutoAddPolicy. Replaced by gpuctl's pinning, on every hop.
    if known.exists():
        client.load_host_keys(str(known))
    if ep.key_alias:
        # paramiko looks keys up by address: show it the alias's keys (and none an earlier machine
        # left under this address), as OpenSSH's HostKeyAlias does.
        keys = client.get_host_keys()
        name = pinned_name(replace(ep, key_alias=""))
        pinned = keys.lookup(ep.key_alias)
        if name in keys:
            del keys[name]
        for kind, key in (pinned or {}).items():
            keys.add(name, kind, key)
    client.set_missing_host_key_policy(_pin_policy(known, ep.key_alias))
    return conn


def _open(conn: Any, remaining: float) -> None:
    step = min(10.0, remaining)
    conn.connect_kwargs.update(timeout=step, banner_timeout=min(15.0, remaining), auth_timeout=min(15.0, remaining))
    if conn.gateway:
        # How long the jump host may take to reach the next hop (paramiko's default is an hour).
        conn.gateway.transport.channel_timeout = min(15.0, remaining)
    conn.open()
    conn.transport.set_keepalive(30)


def close_all(conns: list[Any]) -> None:
    for conn in reversed(conns):  # the host before the jump host that carries it
        try:
            conn.close()  # Fabric closes only a connection that opened: close its client too
            conn.client.close()
        except Exception:  # noqa: BLE001 - closing what may already be half gone
            pass


def _why(exc: BaseException, step: Endpoint, via: Endpoint | None) -> str:
    import paramiko

    if isinstance(exc, paramiko.ChannelException) and via is not None:
        return f"jump host {via.label} could not reach {step.host}:{step.port}: {exc.text}"
    return str(exc) or type(exc).__name__


@dataclass
class _Seen:
    """What the latest try ran into, and at which hop."""

    last: str
    failing: Endpoint


WAIT_EVERY_S = 10.0  # a slow connection is said at its first wait, then once in this many seconds


def open_chain(ep: Endpoint, home: Path, timeout_s: float, retry_auth: bool = False,
               progress: Callable[[str], None] | None = None) -> list[Any]:
    """Open Connections to the jump hosts and the host, retrying with backoff up to `timeout_s`;
    the list ends with the host's. Hops already open are kept across attempts (one connection
    each per command), so a host still booting behind a bastion costs one bastion login."""
    import paramiko

    known = known_hosts_path(home)
    deadline = time.monotonic() + timeout_s
    seen = _Seen("", ep)
    hops: list[Any] = []  # open Connections to ep.jump[0], ep.jump[1], ...
    steps = [*ep.jump, ep]

    def attempt() -> list[Any] | None:
        conn = None
        step, via = ep, None
        try:
            for i, step in enumerate(steps):
                via = steps[i - 1] if i else None
                if i < len(hops):
                    if hops[i].is_connected:
                        continue
                    close_all(hops[i:])
                    del hops[i:]
                conn = _connection(step, known, hops[i - 1] if i else None)
                _open(conn, max(1.0, deadline - time.monotonic()))
                hops.append(conn)
                conn = None
            return hops
        except paramiko.BadHostKeyException as exc:
            close_all(hops + ([conn] if conn else []))
            raise RemoteError(
                f"the host key of {_named(step, ep)} has CHANGED (expected {exc.expected_key.get_name()} "
                f"{exc.expected_key.get_fingerprint().hex()[:16]}..., got {exc.key.get_fingerprint().hex()[:16]}...)",
                f"If the machine was rebuilt, delete its line ({pinned_name(step)}) from {known}; "
                "otherwise do not connect: "
                "someone may be intercepting the connection.",
            ) from None
        except paramiko.AuthenticationException as exc:
            if conn is not None:
                close_all([conn])
            if not retry_auth or time.monotonic() > deadline:
                close_all(hops)
                encrypted = isinstance(exc, paramiko.PasswordRequiredException)
                raise RemoteError(
                    f"{_named(step, ep)} refused the key{(' ' + step.identity) if step.identity else ''}: {exc}",
                    "gpuctl cannot ask for a key's passphrase: pass an unencrypted key with --identity (or "
                    "IdentityFile), or drop the IdentityFile and let ssh-agent hold the key." if encrypted else
                    "Pass the right key with --identity (or IdentityFile in your ssh config), and check it is "
                    "in the host's authorized_keys.",
                ) from None
            seen.last, seen.failing = f"key not accepted yet ({exc})", step
        except socket.gaierror as exc:
            # The name is resolved on this machine (the first hop, or the host itself): a name that
            # does not resolve will not start to while we wait.
            close_all(hops + ([conn] if conn else []))
            raise RemoteError(
                f"cannot resolve {step.host!r} ({_named(step, ep)}): {exc.strerror or exc}",
                "Check the spelling. A short name must be a `Host` in your ssh config (~/.ssh/config, or the "
                "file `remote.ssh_config` names) or a name DNS knows.",
            ) from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            if conn is not None:
                close_all([conn])
            seen.last, seen.failing = _why(exc, step, via), step
        return None

    said = {"at": float("-inf")}

    def waiting(elapsed: float, last: str) -> None:
        # Never silent for long (a train to a host still booting waited 120 s without a word), and
        # not a line per retry either.
        if progress and elapsed - said["at"] >= WAIT_EVERY_S:
            said["at"] = elapsed
            progress(f"waiting for SSH on {ep.name}: {elapsed:.0f} s of {timeout_s:.0f} s ({last})")

    try:
        return poll(attempt, timeout_s, first_delay_s=0.5, max_delay_s=8.0, describe=lambda: seen.last,
                    on_wait=waiting)
    except TimedOut:
        close_all(hops)
        failing = seen.failing
        where = ep.name if failing is ep else f"jump host {failing.label} on the way to {ep.label}"
        raise RemoteError(
            f"cannot connect to {where}: timed out after {timeout_s:.0f}s ({seen.last})",
            "Is the host up and reachable from here? Check the address, the port, any jump host (ProxyJump) "
            "and any firewall or security group (`remote.connect_timeout_s` sets the wait).",
        ) from None


def _named(step: Endpoint, ep: Endpoint) -> str:
    return ep.name if step is ep else f"jump host {step.label} (on the way to {ep.label})"
