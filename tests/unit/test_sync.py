"""Incremental push on the local filesystem, the gitignore rules (checked against git itself where
git is installed), push progress, and push_remote's rsync and tar paths through a stand-in ssh."""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuctl.remote import sync
from gpuctl.remote.host import Deadlines
from gpuctl.remote.sync import (
    IgnoreRules,
    decode_manifest,
    manifest_path,
    push_local,
    scan,
)
from gpuctl.remote.sync import ssh as sync_ssh
from gpuctl.remote.sync.ssh import push_remote


def tree(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)


def pushed(src):
    return sorted(scan(src, IgnoreRules.for_project(src)))


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


def test_nested_gitignore_files_apply_below_their_directory(tmp_path, monkeypatch):
    src = tmp_path / "src"
    tree(src, {
        ".gitignore": "/data/raw\n**/cache/\nbuild/\n",
        "sub/.gitignore": "*.ckpt\n",
        "sub/deep/.gitignore": "!keep.ckpt\n",
        "build/.gitignore": "!*\n",  # inside an ignored directory: never read, as in git
        "train.py": "", "a.ckpt": "", "sub/a.ckpt": "", "sub/deep/keep.ckpt": "", "sub/deep/other.ckpt": "",
        "data/raw/x.bin": "", "data/ok.csv": "", "sub/data/raw/x.bin": "",
        "cache/c": "", "x/y/cache/c": "", "x/y/z.py": "", "build/out.o": "", "sub/build/out.o": "",
    })
    asked = []
    real = IgnoreRules.ignored
    monkeypatch.setattr(IgnoreRules, "ignored", lambda self, rel, is_dir: asked.append(rel) or real(self, rel, is_dir))
    assert pushed(src) == [
        ".gitignore", "a.ckpt", "data/ok.csv",  # *.ckpt lives in sub/.gitignore: not for the top
        "sub/.gitignore", "sub/data/raw/x.bin",  # /data/raw is anchored to the top
        "sub/deep/.gitignore", "sub/deep/keep.ckpt",  # the deeper file re-includes
        "train.py", "x/y/z.py",
    ]
    # Ignored directories are pruned: nothing below them is even asked about.
    assert not [p for p in asked if p.startswith(("build/", "cache/", "x/y/cache/", "sub/build/", "data/raw/"))]


# Each: the ignore files, then what git itself leaves untracked-and-not-ignored there.
IDIOMS = [
    {".gitignore": "*\n!*/\n!*.py\n"},  # only .py files, in every directory
    {".gitignore": "data/**\n!data/README.md\n"},
    {".gitignore": "logs/*\n!logs/keep.txt\n"},
    {".gitignore": "logs/\n!logs/keep.txt\n"},  # git cannot re-include below an ignored directory
    {".gitignore": "data/*\n!data/keep/\n"},
    {".gitignore": "data/*\n", "data/.gitignore": "!keep/\n"},
    {".gitignore": "*.ckpt\ndeep/\n", "sub/.gitignore": "!deep/\n"},  # deep/ is back, its *.ckpt are not
    {".gitignore": "*/\n!sub/\n"},  # sub/ is back, the directories in it are not
    {".gitignore": "/*\n!/sub\n", "sub/.gitignore": "deep\n"},
    {".gitignore": "doc/**\n!doc/**/\n!*.md\n"},
    {".gitignore": "doc/**/\n"},  # the directories below doc/, not doc/ itself
    {".gitignore": "a/**/e.npy\nsub/**/*.ckpt\n!sub/deep/keep.ckpt\n"},
    {".gitignore": "*.ckpt\n", "sub/.gitignore": "!*.ckpt\n", "sub/deep/.gitignore": "x.ckpt\n"},
]
IDIOM_FILES = ["a.py", "x.ckpt", "sub/a.ckpt", "sub/deep/keep.ckpt", "sub/deep/x.ckpt", "sub/build/z.py",
               "logs/a.txt", "logs/keep.txt", "data/README.md", "data/keep/x.bin", "data/other/y.bin", "data/z.bin",
               "doc/a.md", "doc/sub/b.md", "doc/sub/c.txt", "a/e.npy", "a/b/c/e.npy", "sub/sub/x.py"]


@pytest.mark.skipif(not shutil.which("git"), reason="compares with git itself")
@pytest.mark.parametrize("ignores", IDIOMS, ids=lambda ig: " | ".join(ig.values()).replace("\n", " "))
def test_ignore_rules_agree_with_git(tmp_path, ignores):
    src = tmp_path / "src"
    tree(src, {f: "x" for f in IDIOM_FILES} | ignores)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    out = subprocess.run(["git", "-c", "core.excludesFile=/dev/null", "ls-files", "-oz", "--exclude-standard"],
                         cwd=src, capture_output=True, check=True).stdout
    assert pushed(src) == sorted(os.fsdecode(p) for p in out.split(b"\0") if p)


def test_gpuctlignore_comes_after_gitignore(tmp_path):
    src = tmp_path / "src"
    tree(src, {
        ".gitignore": "*.ckpt\nlogs/\n",
        ".gpuctlignore": "!best.ckpt\n!logs/\nlogs/*.tmp\nscratch/\n",
        "best.ckpt": "", "last.ckpt": "", "logs/a.txt": "", "logs/b.tmp": "", "scratch/s": "", "sub/best.ckpt": "",
    })
    assert pushed(src) == [".gitignore", ".gpuctlignore", "best.ckpt", "logs/a.txt", "sub/best.ckpt"]


def test_default_ignores_can_be_re_included(tmp_path):
    src = tmp_path / "src"
    tree(src, {
        ".gitignore": "!.ipynb_checkpoints/\n!*.pyc\n!__pycache__/m.pyc\n",
        ".ipynb_checkpoints/n.ipynb": "", "tool.pyc": "", "__pycache__/m.pyc": "", ".venv/bin/python": "",
        ".git/HEAD": "", sync.MANIFEST: "",
    })
    # __pycache__/ stays ignored as a directory, so nothing in it comes back (as in git).
    assert pushed(src) == [".gitignore", ".ipynb_checkpoints/n.ipynb", "tool.pyc"]


def test_odd_ignore_files_do_not_break_a_push(tmp_path):
    """Tried: a lone `!`, a lone `\\`, an unclosed `[`, a reversed range `[z-a]`, `[[:bogus:]]`
    (re warns about nested sets), `!!`, `[]`, a bare `/`, unescaped and escaped trailing spaces,
    CRLF line ends, a UTF-8 BOM, a Latin-1 pattern (not UTF-8) naming a Latin-1 file, a NUL byte,
    a 100 KB line, a .gitignore that is a directory, and a UTF-16 .gpuctlignore. Git drops the
    invalid lines and so do we; the rest still apply, and no warning reaches the user."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    latin = os.fsdecode(b"caf\xe9.bin")
    tree(src, {f: "x" for f in ["a.py", "b.log", "[x]", latin, os.fsdecode(b"na\xefve.bin"), "sp ", "sp", "sub/k"]})
    (src / ".gitignore").write_bytes(
        b"\xef\xbb\xbf!\r\n\\\n[\r\n[z-a]\n[[:bogus:]]\n!!\n[]\n/\n*.log   \r\ncaf\xe9.bin\n\x00\n"
        + b"a" * 100_000 + b"\nsp\\ \n")
    (src / "sub" / ".gitignore").mkdir()
    (src / ".gpuctlignore").write_bytes("[x]\n".encode("utf-16"))  # nonsense to us: no pattern matches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = push_local(src, dest)
    expected = [".gitignore", ".gpuctlignore", "[x]", "a.py", os.fsdecode(b"na\xefve.bin"), "sp", "sub/k"]
    assert sorted(decode_manifest(Path(manifest_path(str(dest))).read_bytes())) == sorted(expected)
    assert stats.files_copied == len(expected)


def test_push_local_progress(tmp_path, monkeypatch):
    src, dest = tmp_path / "src", tmp_path / "dest"
    tree(src, {f"pkg/m{i}.py": "x" * 100 for i in range(300)})
    lines = []
    push_local(src, dest, progress=lines.append)  # at most a line a second: some, maybe none, between
    assert lines[0] == "scanned 300 files (30.0 KB)" and lines[-1].startswith("pushed 300 of 300 files, 30.0 KB in ")
    assert all(ln.startswith("sent ") for ln in lines[1:-1])

    monkeypatch.setattr(sync, "PROGRESS_EVERY_S", 0)  # every line through, to see each one
    for i in range(300):
        os.utime(src / f"pkg/m{i}.py", ns=(i, i))
    lines = []
    push_local(src, dest, progress=lines.append)
    assert [ln.split(",")[0] for ln in lines[1:-1]] == [f"sent {i}/300 files" for i in range(1, 301)]
    assert lines[-2].startswith("sent 300/300 files, 30.0 KB of 30.0 KB, ") and lines[-2].endswith("/s")

    lines = []
    push_local(src, dest, progress=lines.append)
    assert lines[0] == "scanned 300 files (30.0 KB)" and lines[1].startswith("up to date: 300 files unchanged")


def test_meter_passes_a_line_a_second_and_always_the_last():
    now, lines = [0.0], []
    meter = sync.Meter(lines.append, clock=lambda: now[0])
    for t in (0.0, 0.5, 0.99, 1.0, 1.7, 2.05, 2.1):
        now[0] = t
        meter(f"at {t}")
    meter.final("done")
    assert lines == ["at 0.0", "at 1.0", "at 2.05", "done"]
    quiet = sync.Meter(None)
    quiet("x")
    quiet.final("y")  # nobody listening: nothing to do, nothing raised
    assert not quiet.due()


def test_rsync_progress2_lines():
    def line(text):
        m = sync_ssh._PROGRESS2.match(text)
        return m and sync_ssh._progress2_line(m, 2.0)

    assert line("      6,000,000 100%   89.11MB/s    0:00:00 (xfr#300, to-chk=0/301)") == \
        "sent 300 files, 6.0 MB, 3.0 MB/s (301/301 checked)"
    assert line("     1.238.099  45%    1,23MB/s    0:00:01 (xfr#12, ir-chk=1000/1002)") == \
        "sent 12 files, 1.2 MB, 619.0 KB/s (2/1,002 checked)"
    assert line("         20,000   0%    0.00kB/s    0:00:00  ") == "sent 0 files, 20.0 KB, 10.0 KB/s"
    for other in ("Number of files: 301 (reg: 300, dir: 1)", "Total bytes sent: 6,017,785", "",
                  "sent 6,017,785 bytes  received 5,723 bytes  12,047,016.00 bytes/sec"):
        assert line(other) is None


FAKE_SSH = """\
import os, sys
args = sys.argv[1:]
while args[0].startswith("-"):  # rsync runs: <this> -l USER HOST COMMAND...
    args = args[2:] if args[0] == "-l" else args[1:]
if MISSING:
    sys.stderr.write("sh: 1: rsync: not found\\n")  # what a host without rsync answers
    sys.exit(127)
os.execvp("sh", ["sh", "-c", " ".join(args[1:])])
"""


class StandInHost(Deadlines):
    """What push_remote uses of SshHost, on this machine; "ssh" is a script running the command here."""

    def __init__(self, tmp_path, rsync_missing=False):
        self.has_rsync, self.label, self.ep = None, "stand-in", SimpleNamespace(user="u", host="h")
        self.script = tmp_path / "fake_ssh.py"
        self.script.write_text(FAKE_SSH.replace("MISSING", repr(rsync_missing)))

    def ssh_argv(self):
        return [sys.executable, str(self.script)]

    def makedirs(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)

    def read_bytes(self, path, offset=0, limit=8 << 20):
        return Path(path).read_bytes()[offset:offset + limit] if Path(path).is_file() else None

    def write_bytes(self, path, data, mode=0o644):
        Path(path).write_bytes(data)

    def run(self, argv, check=True, timeout=None, stdin=None):
        res = subprocess.run(argv, input=stdin, capture_output=True, check=False)
        return SimpleNamespace(returncode=res.returncode, stdout=res.stdout.decode(), stderr=res.stderr.decode())

    def run_feeding(self, argv, feed):
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err)
            try:
                feed(proc.stdin)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            except BaseException:  # as SshHost: the command sees its input end, then the error goes on
                proc.stdin.close()
                proc.wait()
                raise
            code = proc.wait()
            out.seek(0), err.seek(0)
            return SimpleNamespace(returncode=code, stdout=out.read().decode(), stderr=err.read().decode())


@pytest.mark.skipif(not shutil.which("rsync"), reason="needs rsync")
def test_push_remote_reports_rsync_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "PROGRESS_EVERY_S", 0)
    src, dest = tmp_path / "src", str(tmp_path / "remote" / "code")
    tree(src, {f"pkg/m{i}.bin": b"\0" * 2000 for i in range(300)} | {"we ird $(touch x) 'q'.py": "odd"})
    host, lines = StandInHost(tmp_path), []
    first = push_remote(host, src, dest, progress=lines.append)
    assert host.has_rsync is True and first.files_copied == first.files_total == 301
    assert lines[0] == "scanned 301 files (600.0 KB)" and lines[-1].startswith("pushed 301 of 301 files, ")
    if sync_ssh._rsync_has_progress2():
        assert any(ln.startswith("sent 301 files, 600.0 KB, ") for ln in lines)
    assert (Path(dest) / "we ird $(touch x) 'q'.py").read_text() == "odd"

    (src / "pkg" / "m7.bin").unlink()
    lines = []
    again = push_remote(host, src, dest, progress=lines.append)
    assert (again.files_copied, again.files_deleted) == (0, 1) and not (Path(dest) / "pkg" / "m7.bin").exists()
    assert lines[-1].startswith("pushed 0 of 300 files") and lines[-1].endswith("1 deleted")
    assert push_remote(host, src, dest).files_copied == 0  # no progress asked: the same push, silent


@pytest.mark.skipif(not shutil.which("rsync"), reason="needs rsync")
def test_push_remote_falls_back_to_tar_with_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "PROGRESS_EVERY_S", 0)
    src, dest = tmp_path / "src", str(tmp_path / "remote" / "code")
    tree(src, {f"m{i}.py": "x" for i in range(5)})
    host, lines = StandInHost(tmp_path, rsync_missing=True), []
    stats = push_remote(host, src, dest, progress=lines.append)
    assert host.has_rsync is False and stats.files_copied == 5
    assert lines[1].startswith("sent ") and " of 0.0 MB as a tar stream, " in lines[1]
    assert lines[-1].startswith("pushed 5 of 5 files, ")
    assert sorted(p.name for p in Path(dest).iterdir()) == [f"m{i}.py" for i in range(5)]
