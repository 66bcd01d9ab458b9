"""gpuctl/files.py: the one writer of private files in the home (ssh configs, pinned host keys,
keys, archived logs, the dashboard's token, the latest plan)."""

from __future__ import annotations

import os
import stat

import pytest

from gpuctl.files import write_private
from gpuctl.remote.ssh.known_hosts import forget_host_keys, known_hosts_path


def test_private_from_the_first_byte_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        write_private(tmp_path / "a", "secret")
        write_private(tmp_path / "b", b"\x00bytes")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o600
    assert (tmp_path / "a").read_text() == "secret" and (tmp_path / "b").read_bytes() == b"\x00bytes"


def test_replaces_whole_and_leaves_no_temporary_file_on_failure(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    target = folder / "f"
    write_private(target, "old")
    with pytest.raises(TypeError):
        write_private(target, 42)  # type: ignore[arg-type]  # fails after the temporary file is made
    assert target.read_text() == "old" and os.listdir(folder) == ["f"]


def test_dropping_host_key_pins_keeps_the_file_private(tmp_path):
    path = known_hosts_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("gone ssh-ed25519 AAAA\nkept ssh-ed25519 BBBB\n")
    os.chmod(path, 0o644)  # as an older gpuctl or an editor may leave it
    old = os.umask(0)
    try:
        assert forget_host_keys(tmp_path, {"gone"}) == 1
    finally:
        os.umask(old)
    assert path.read_text() == "kept ssh-ed25519 BBBB\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
