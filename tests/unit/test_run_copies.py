"""A run's own copy of what was pushed is hard links (remote/sync/link.py): safe only if every push
replaces a changed file with a new inode, never writes into it (push_local, rsync, the tar
unpacker). And a run's code version read from a git checkout as files (ops/provenance.py).

Bad inputs tried: HEAD naming a ref that climbs out (`ref: ../../../etc/passwd`), HEAD a FIFO,
a symbolic ref that points at itself, a .git file pointing nowhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuctl.ops import provenance
from gpuctl.remote.sync import push_local
from gpuctl.remote.sync.link import link_argv, link_local
from gpuctl.remote.sync.ssh import push_remote
from tests.unit.test_sync import StandInHost


@pytest.mark.parametrize("how", ["local", "rsync", "tar"])
def test_a_push_replaces_a_changed_file_so_a_linked_copy_keeps_the_old(tmp_path, how):
    if how == "rsync" and not shutil.which("rsync"):
        pytest.skip("needs rsync")
    host = StandInHost(tmp_path, rsync_missing=how == "tar")

    def push(src: Path, dest: Path) -> None:
        push_local(src, dest) if how == "local" else push_remote(host, src, str(dest))

    src, dest, run = tmp_path / "src", tmp_path / "host" / "code", tmp_path / "host" / "runs" / "r1" / "code"
    src.mkdir()
    (src / "train.py").write_text("v1 " * 100)
    (src / "same.py").write_text("unchanged\n")
    push(src, dest)
    link_local(dest, run)
    assert (run / "train.py").stat().st_ino == (dest / "train.py").stat().st_ino
    (src / "train.py").write_text("v2 " * 100)  # the same size: only content and mtime differ
    os.utime(src / "train.py", ns=(1, 2_000_000_000))
    push(src, dest)
    assert (dest / "train.py").read_text().startswith("v2") and (run / "train.py").read_text().startswith("v1")
    assert (run / "same.py").stat().st_ino == (dest / "same.py").stat().st_ino  # unchanged: still shared


def test_linking_again_replaces_pushed_files_and_keeps_what_the_job_wrote(tmp_path):
    src, run = tmp_path / "code", tmp_path / "runs" / "r1" / "code"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("1")
    assert link_local(src, run) == 1
    (run / "model.keras").write_text("the job's")
    (src / "pkg" / ".m.tmp").write_text("2")
    os.replace(src / "pkg" / ".m.tmp", src / "pkg" / "m.py")
    link_local(src, run)
    assert (run / "pkg" / "m.py").read_text() == "2" and (run / "model.keras").read_text() == "the job's"


def test_the_remote_link_command_links_odd_names_through_one_quoted_command(tmp_path):
    src, run = tmp_path / "it's $(x)", tmp_path / "runs" / "a b" / "code"
    src.mkdir()
    (src / "f").write_text("x")
    subprocess.run(link_argv(str(src), str(run)), check=True)
    subprocess.run(link_argv(str(src), str(run)), check=True)  # again over itself: fine
    assert (run / "f").stat().st_ino == (src / "f").stat().st_ino and not (run / src.name).exists()


def _git(repo: Path, *args: str) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not shutil.which("git"), reason="needs git to make the checkouts")
def test_the_commit_is_read_from_loose_packed_and_worktree_refs(tmp_path):
    repo = tmp_path / "repo"
    (repo / "proj").mkdir(parents=True)
    (repo / "proj" / "train.py").write_text("x")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert provenance.git_commit(repo / "proj") == head  # the project is a subdirectory of the checkout
    _git(repo, "pack-refs", "--all")
    assert provenance.git_commit(repo / "proj") == head
    _git(repo, "worktree", "add", "-q", str(tmp_path / "wt"))
    assert provenance.git_commit(tmp_path / "wt" / "proj") == head  # .git is a file; refs in the main repo
    _git(repo, "checkout", "-q", "--detach")
    assert provenance.git_commit(repo) == head


@pytest.mark.skipif(not shutil.which("git"), reason="needs git to make the checkouts")
def test_dirty_says_whether_what_is_pushed_is_the_commits(tmp_path):
    repo = tmp_path / "repo"
    proj = repo / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "train.py").write_text("x")
    (proj / "pkg" / "m.py").write_text("m")
    (proj / ".gitignore").write_text("out/\n")
    (repo / "other.txt").write_text("outside the project")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    assert provenance.of(proj).dirty is False
    (repo / "other.txt").write_text("changed outside the project: not this code")
    (proj / "out").mkdir()
    (proj / "out" / "model.h5").write_text("ignored: never pushed")
    assert provenance.of(proj).dirty is False
    (proj / "pkg" / "m.py").write_text("m2")
    assert provenance.of(proj).dirty is True
    (proj / "pkg" / "m.py").write_text("m")
    assert provenance.of(proj).dirty is False
    (proj / "new.py").write_text("untracked, pushed")
    assert provenance.of(proj).dirty is True
    (proj / "new.py").unlink()
    (proj / "train.py").unlink()
    assert provenance.of(proj).dirty is True
    (proj / "train.py").write_text("x")
    _git(repo, "gc", "-q")  # the objects packed (and deltified): read the same
    assert not list((repo / ".git" / "objects").glob("??/*"))
    assert provenance.of(proj).dirty is False
    _git(repo, "worktree", "add", "-q", str(tmp_path / "wt"))
    assert provenance.of(tmp_path / "wt" / "proj").dirty is False
    (tmp_path / "wt" / "proj" / "train.py").write_text("y")
    assert provenance.of(tmp_path / "wt" / "proj").dirty is True
    # A cloned repository's config that would run a command if git ran here (the test's own git
    # calls are done).
    with open(repo / ".git" / "config", "a") as fh:
        fh.write(f"[core]\n\tfsmonitor = touch {tmp_path / 'ran'}\n")
    assert provenance.of(tmp_path / "wt" / "proj").dirty is True and provenance.of(proj).dirty is False
    assert not (tmp_path / "ran").exists()
    for pack in (repo / ".git" / "objects" / "pack").iterdir():
        pack.chmod(0o600)
        pack.write_bytes(b"corrupt")
    code = provenance.of(proj)
    assert code.commit is not None and code.dirty is None  # not told, never said clean


def test_a_hostile_git_dir_gives_no_commit_and_reads_nothing_outside(tmp_path):
    proj = tmp_path / "p"
    (proj / ".git" / "refs").mkdir(parents=True)
    (proj / "train.py").write_text("x")
    head = proj / ".git" / "HEAD"
    for text in ("ref: ../../../etc/passwd", "ref: refs/heads/../../../x", "ref: refs/loop", "junk"):
        head.write_text(text)
        (proj / ".git" / "refs" / "loop").write_text("ref: refs/loop")
        assert provenance.git_commit(proj) is None
    head.unlink()
    os.mkfifo(head)  # would block an open() without O_NONBLOCK
    assert provenance.git_commit(proj) is None
    assert provenance.of(proj).commit is None and len(provenance.of(proj).hash) == 12
    shutil.rmtree(proj / ".git")
    (proj / ".git").write_text("gitdir: /nowhere/at/all")
    assert provenance.git_commit(proj) is None


def test_the_code_hash_follows_content_and_paths_not_times(tmp_path):
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "a.py").write_text("1")
    first = provenance.tree_hash(proj)
    os.utime(proj / "a.py", ns=(1, 1))
    assert provenance.tree_hash(proj) == first
    (proj / "a.py").write_text("2")
    assert provenance.tree_hash(proj) != first
    (proj / "a.py").write_text("1")
    (proj / "a.py").rename(proj / "b.py")
    assert provenance.tree_hash(proj) != first
