"""The known_hosts file in the gpuctl home, where every hop's host key is pinned (Fabric and
OpenSSH both verify against it), and the dropping of pins of released instances."""

from __future__ import annotations

from pathlib import Path

from gpuctl.files import write_private


def known_hosts_path(home: Path) -> Path:
    return home / "known_hosts"


def forget_host_keys(home: Path, names: set[str]) -> int:
    """Drop the pins of these names (key aliases of released instances); how many lines went."""
    path = known_hosts_path(home)
    if not names or not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.split(" ", 1)[0] not in names]
    if len(kept) != len(lines):
        write_private(path, "".join(kept))
    return len(lines) - len(kept)
