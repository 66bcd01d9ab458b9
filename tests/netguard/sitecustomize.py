"""Loaded by subprocesses the tests start (PYTHONPATH): any connection to an address that is not
loopback nor one of the tests' own SSH hosts (10.251.0.0/16, in namespaces the tests create)
fails loudly, so no test can reach a real cloud or the internet."""

import socket

_connect = socket.socket.connect


def _guarded(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and self.family in (socket.AF_INET, socket.AF_INET6):
        if not (host.startswith(("127.", "10.251.")) or host in ("::1", "localhost")):
            raise ConnectionRefusedError(f"test network guard: refused connection to non-loopback {host}")
    return _connect(self, address)


socket.socket.connect = _guarded
