"""Which nodes see one work dir, on this machine's real filesystem: LocalHosts
whose roots are one directory (as two lab hosts with one NFS home are), or a link to it."""

from __future__ import annotations

import os

from gpuctl.ops.workdirs import TOKEN, sharing, subdir
from gpuctl.remote.local import LocalHost


def test_nodes_whose_work_dir_is_one_are_found_and_the_others_are_not(tmp_path):
    shared, own, other = tmp_path / "home" / "gpuctl", tmp_path / "own", tmp_path / "other"
    for d in (shared, own, other):
        d.mkdir(parents=True)
    os.symlink(shared, tmp_path / "mounted-again")  # another path to the same directory
    hosts = [LocalHost(shared), LocalHost(own), LocalHost(tmp_path / "mounted-again"), LocalHost(other),
             LocalHost(shared)]
    assert sharing(hosts) == [{0, 2, 4}]
    # The tokens are gone again; nothing else was written.
    assert not [p for d in (shared, own, other) for p in d.iterdir() if p.name.startswith(TOKEN)]


def test_separate_work_dirs_share_nothing(tmp_path):
    hosts = [LocalHost(tmp_path / str(i)) for i in range(3)]
    for h in hosts:
        os.makedirs(h.root)
    assert sharing(hosts) == []
    assert subdir("/home/u/gpuctl/box", 1) == "/home/u/gpuctl/box/node-1"
