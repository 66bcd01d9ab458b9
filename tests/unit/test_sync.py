"""Incremental push on the local filesystem, and the gitignore subset."""

import os

from gpuctl.remote.sync import IgnoreRules, decode_manifest, manifest_path, push_local


def tree(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_ignore_rules():
    rules = IgnoreRules(["*.log", "/build/", "data/**/*.npy", "!keep.log", "# comment", "", "cache/"])
    assert rules.ignored("a.log", False) and rules.ignored("x/y/a.log", False)
    assert not rules.ignored("keep.log", False)
    assert rules.ignored("build", True) and not rules.ignored("src/build", True)
    assert not rules.ignored("build", False)  # dir-only rule
    assert rules.ignored("data/a/b/c.npy", False) and rules.ignored("data/c.npy", False)
    assert rules.ignored("deep/cache", True)
    assert not rules.ignored("train.py", False)


def test_push_is_incremental_and_keeps_job_outputs(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    tree(src, {
        "train.py": "print(1)\n", "lib/model.py": "x = 1\n", "notes.log": "noise",
        ".gitignore": "*.log\n", ".gpuctlignore": "secret/\n", "secret/key": "k",
        "__pycache__/m.pyc": "b", ".git/HEAD": "ref",
    })
    first = push_local(src, dest)
    assert first.files_copied == first.files_total == 4  # train.py, lib/model.py, both ignore files
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == sorted(
        [".gitignore", ".gpuctlignore", "lib/model.py", "train.py"]
    )
    assert manifest_path(str(dest)) == str(tmp_path / ".dest.gpuctl-manifest")
    assert sorted(decode_manifest((tmp_path / ".dest.gpuctl-manifest").read_bytes())) == [
        ".gitignore", ".gpuctlignore", "lib/model.py", "train.py"]

    again = push_local(src, dest)
    assert (again.files_copied, again.bytes_copied, again.files_deleted) == (0, 0, 0)

    (dest / "checkpoint.h5").write_text("weights")  # written by the job, not by a push
    (src / "lib" / "model.py").write_text("x = 2  # changed\n")
    os.utime(src / "lib" / "model.py", ns=(1, 1))
    (src / "train.py").unlink()
    third = push_local(src, dest)
    assert (third.files_copied, third.files_deleted) == (1, 1)
    assert third.bytes_copied == len("x = 2  # changed\n")
    assert (dest / "lib" / "model.py").read_text() == "x = 2  # changed\n"
    assert not (dest / "train.py").exists()
    assert (dest / "checkpoint.h5").read_text() == "weights"


def test_push_repairs_a_file_deleted_on_the_instance(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    tree(src, {"a.py": "a"})
    push_local(src, dest)
    (dest / "a.py").unlink()
    assert push_local(src, dest).files_copied == 1
