"""Untrusted files without a network: what an instance lists or left behind (names,
links, the push manifest) decides nothing outside the target, and a project's odd entries follow
one policy on every provider.

Bad inputs tried: names `../../x`, `/abs`, `.`, `a/b` from a listing; links `-> /root/.ssh`,
`-> ../../etc`, dangling links, FIFOs; manifests holding `../victim`, an absolute path, a list,
strings for sizes, booleans, garbage bytes; a project with links out, a loop and a FIFO; sixteen
pushes into one destination at once."""

from __future__ import annotations

import os
import stat
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpuctl.remote.sync import decode_manifest, encode_manifest, manifest_path, push_local
from gpuctl.remote.sync.pull import LocalFiles, link_stays_inside, pull_walk
from gpuctl.remote.sync.ssh import push_remote
from tests.unit.test_sync import StandInHost, tree


class Entry:
    def __init__(self, filename, st_mode):
        self.filename, self.st_mode = filename, st_mode


class HostileSftp:
    """An SFTP server that lists what it likes."""

    def __init__(self):
        self.listing = {
            "/run": [Entry("../../x", stat.S_IFREG), Entry("/abs", stat.S_IFREG), Entry(".", stat.S_IFDIR),
                     Entry("a/b", stat.S_IFREG), Entry("ok.txt", stat.S_IFREG), Entry("sub", stat.S_IFDIR),
                     Entry("ssh", stat.S_IFLNK), Entry("up", stat.S_IFLNK), Entry("in", stat.S_IFLNK),
                     Entry("fifo", stat.S_IFIFO)],
            "/run/sub": [Entry("deep.txt", stat.S_IFREG), Entry("back", stat.S_IFLNK), Entry("out", stat.S_IFLNK)],
        }
        self.links = {"/run/ssh": "/root/.ssh", "/run/up": "../../etc", "/run/in": "sub/deep.txt",
                      "/run/sub/back": "../ok.txt", "/run/sub/out": "../../x"}
        self.got = []

    def listdir_attr(self, path):
        return self.listing[path]

    def readlink(self, path):
        return self.links[path]

    def getfo(self, path, fh):
        self.got.append(path)
        fh.write(f"content of {path}".encode())


def test_a_pull_keeps_whatever_the_instance_lists_inside_the_target(tmp_path):
    target = tmp_path / "runs" / "r1"
    files, skipped = pull_walk(HostileSftp(), "/run", target)
    assert files == 2 and (target / "ok.txt").read_text() == "content of /run/ok.txt"
    assert (target / "sub" / "deep.txt").exists()
    assert os.readlink(target / "in") == "sub/deep.txt" and os.readlink(target / "sub" / "back") == "../ok.txt"
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs" / "x").exists()
    assert not (target / "ssh").exists() and not (target / "up").exists() and not (target / "sub" / "out").exists()
    assert sorted(s.split(":")[0] for s in skipped) == ["'.'", "'../../x'", "'/abs'", "'a/b'", "fifo", "ssh", "sub/out",
                                                         "up"]
    assert {p.name for p in (tmp_path / "runs").rglob("*")} <= {"r1", "ok.txt", "sub", "deep.txt", "in", "back"}


def test_link_targets_inside_and_outside():
    assert link_stays_inside("a/b", "../c") and link_stays_inside("a", "b/c")
    for rel, target in [("a", "/etc"), ("a", "../x"), ("a/b", "../../x"), ("a", ""), ("a", "b/../../x")]:
        assert not link_stays_inside(rel, target), (rel, target)


def test_a_local_pull_follows_the_same_policy(tmp_path):
    run = tmp_path / "run"
    tree(run, {"outputs/model.txt": "w"})
    (run / "outputs" / "keys").symlink_to(tmp_path)  # a directory outside the run
    (run / "outputs" / "alias").symlink_to("model.txt")
    (run / "outputs" / "gone").symlink_to("/nonexistent")
    os.mkfifo(run / "outputs" / "pipe")
    files, skipped = pull_walk(LocalFiles(), str(run), tmp_path / "back")
    assert files == 1 and os.readlink(tmp_path / "back" / "outputs" / "alias") == "model.txt"
    assert {s.split(":")[0] for s in skipped} == {"outputs/keys", "outputs/gone", "outputs/pipe"}


@pytest.mark.parametrize("manifest", [
    {"../victim": [1, 1]}, {"/tmp/victim": [1, 1]}, {"a/../../victim": [1, 1]}, {"ok": ["1", 2]},
    {"ok": [True, 1]}, {"ok": [1]}, ["ok"], {"": [1, 1]},
])
def test_an_untrusted_manifest_is_void_as_a_whole(manifest):
    import json

    assert decode_manifest(zlib.compress(json.dumps(manifest).encode())) == {}
    assert decode_manifest(b"garbage") == {} and decode_manifest(zlib.compress(b"\xff")) == {}


@pytest.mark.parametrize("where", ["local", "remote-rsync", "remote-tar"])
def test_a_planted_manifest_never_deletes_outside_the_destination(tmp_path, where):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    src, dest = tmp_path / "src", tmp_path / "remote" / "code"
    tree(src, {"train.py": "x"})
    dest.mkdir(parents=True)
    # The previous push "had" the victim: a manifest written on the instance by someone else.
    Path(manifest_path(str(dest))).write_bytes(encode_manifest({"../../victim": (4, 1), str(victim): (4, 1)}))
    if where == "local":
        stats = push_local(src, dest)
    else:
        stats = push_remote(StandInHost(tmp_path, rsync_missing=where == "remote-tar"), src, str(dest))
    assert victim.read_text() == "mine" and stats.files_deleted == 0
    assert (dest / "train.py").read_text() == "x"  # a full push


def odd_project(tmp_path: Path) -> Path:
    src = tmp_path / "proj"
    tree(src, {"train.py": "main", "lib/util.py": "u", "data/a.bin": "a"})
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (src / "alias.py").symlink_to("lib/util.py")  # inside: followed
    (src / "datalink").symlink_to("data")  # a directory inside: followed
    (src / "leak.txt").symlink_to(outside)  # out of the project: skipped
    (src / "home").symlink_to(tmp_path)  # a directory out of it: skipped
    (src / "loop").symlink_to(".")  # the project itself again: skipped
    (src / "gone.py").symlink_to("nowhere.py")  # dangling: skipped
    os.mkfifo(src / "pipe")  # special: skipped (reading it would hang)
    return src


@pytest.mark.parametrize("where", ["local", "remote-rsync", "remote-tar"])
def test_odd_entries_in_a_project_follow_one_policy_everywhere(tmp_path, where):
    src, dest = odd_project(tmp_path), tmp_path / "remote" / "code"
    if where == "local":
        stats = push_local(src, dest)
    else:
        stats = push_remote(StandInHost(tmp_path, rsync_missing=where == "remote-tar"), src, str(dest))
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["alias.py", "data/a.bin", "datalink/a.bin", "lib/util.py", "train.py"]
    assert (dest / "alias.py").read_text() == "u" and not (dest / "alias.py").is_symlink()
    assert sorted(s.split(":")[0] for s in stats.skipped) == ["gone.py", "home/", "leak.txt", "loop/", "pipe"]
    assert not any("secret" in p.read_text() for p in dest.rglob("*") if p.is_file())


def test_sixteen_pushes_into_one_place_at_once_all_succeed(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    tree(src, {f"f{i}.txt": str(i) for i in range(40)})
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: push_local(src, dest), range(16)))
    assert all(r.files_total == 40 for r in results)
    assert sorted(p.name for p in dest.iterdir()) == sorted(f"f{i}.txt" for i in range(40))


@pytest.mark.skipif(sys.platform != "linux", reason="the FIFO check reads no data either way")
def test_a_fifo_does_not_hang_the_scan(tmp_path):
    src = tmp_path / "p"
    tree(src, {"a.py": "a"})
    os.mkfifo(src / "f")
    assert push_local(src, tmp_path / "d").skipped == ("f: not a regular file (a FIFO, socket or device)",)


class ChainedLinksSftp(HostileSftp):
    """The review's attack: a link that looks inside but climbs through another link, and a name
    listed twice, first as a directory (written into later) and then as a link."""

    def __init__(self):
        super().__init__()
        self.listing = {
            "/run": [Entry("a", stat.S_IFDIR), Entry("X", stat.S_IFDIR), Entry("X", stat.S_IFLNK),
                     Entry("Y", stat.S_IFLNK)],
            "/run/a": [Entry("b", stat.S_IFDIR)],
            "/run/a/b": [Entry("c", stat.S_IFLNK)],
            "/run/X": [Entry(".bashrc", stat.S_IFREG)],
        }
        self.links = {"/run/a/b/c": "../..", "/run/X": "a/b/c/../../..", "/run/Y": "a/b/c/../../.."}


def test_a_pull_cannot_be_led_out_through_chained_links_or_a_name_listed_twice(tmp_path):
    target = tmp_path / "dest" / "run-1"
    files, skipped = pull_walk(ChainedLinksSftp(), "/run", target)
    assert not (tmp_path / "dest" / ".bashrc").exists() and not (tmp_path / ".bashrc").exists()
    assert (target / "X" / ".bashrc").is_file() and not (target / "X").is_symlink()
    assert not os.path.lexists(target / "Y")  # `..` after a name: refused
    assert os.readlink(target / "a" / "b" / "c") == "../.."  # climbs to the top, not above it
    assert any("listed twice" in s for s in skipped)
    assert link_stays_inside("a/b/c", "../..") and not link_stays_inside("a/b/c", "../../..")
    assert not link_stays_inside("X", "a/b/c/../../..")


def test_a_file_that_changes_during_a_tar_push_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """Review finding: a file that vanished or shrank mid-push left the host's unpacker waiting
    for the rest of the stream, and `train` hung holding the cluster lock."""
    from gpuctl.errors import ProjectError
    from gpuctl.remote.sync import tar as tar_push

    src, dest = tmp_path / "src", tmp_path / "remote" / "code"
    tree(src, {"a.txt": "old a", "b.txt": "old b"})
    host = StandInHost(tmp_path, rsync_missing=True)
    push_remote(host, src, str(dest))
    tree(src, {"a.txt": "new a", "b.txt": "new b, longer"})
    real_open = open

    def vanishing(path, *args, **kwargs):
        if str(path).endswith("b.txt"):
            raise FileNotFoundError(2, "No such file or directory")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(tar_push, "open", vanishing, raising=False)
    with pytest.raises(ProjectError, match="b.txt changed while it was pushed"):
        push_remote(host, src, str(dest))
    assert (dest / "b.txt").read_text() == "old b"  # whole, as it was
    assert not [p for p in dest.iterdir() if "gpuctl-tmp" in p.name]


def test_two_links_leading_into_each_other_are_one_loop_not_forty(tmp_path):
    src = tmp_path / "p"
    tree(src, {"a/x.py": "x", "c/y.py": "y"})
    (src / "a" / "b").symlink_to("../c")
    (src / "c" / "d").symlink_to("../a")
    stats = push_local(src, tmp_path / "d")
    got = sorted(str(p.relative_to(tmp_path / "d")) for p in (tmp_path / "d").rglob("*") if p.is_file())
    assert got == ["a/b/y.py", "a/x.py", "c/d/x.py", "c/y.py"]
    assert sorted(s.split(":")[0] for s in stats.skipped) == ["a/b/d/", "c/d/b/"]


def test_pulled_modes_lose_special_bits_and_what_the_umask_takes():
    """The one rule both pull paths apply (rsync gets it as --chmod)."""
    from gpuctl.remote.sync.pull import pulled_mode, rsync_chmod

    assert pulled_mode(0o104755, False, 0o022) == 0o755  # setuid gone
    assert pulled_mode(0o100600, False, 0o022) == 0o600  # never widened to the umask's 0644
    assert pulled_mode(0o041777, True, 0o022) == 0o755  # sticky gone, others' write too
    assert pulled_mode(0o100444, False, 0o077) == 0o600  # the owner may always read and write
    assert pulled_mode(0o040500, True, 0o077) == 0o700
    assert rsync_chmod(0o022) == "ugo-st,g-w,o-w,u+rw,Du+x"
    assert rsync_chmod(0o077) == "ugo-st,g-rwx,o-rwx,u+rw,Du+x"
