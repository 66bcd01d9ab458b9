"""A push says what its ignore rules leave out that the run may need (issue 37, item 4): a
directory the script's arguments name, or more than a few MB in all, each with the rule that did
it; and a refusal that needs no files (no usable TensorFlow) comes before the push.

Local provider and real tmux; the refusal on a real sshd host (tests/sshd.py).

Bad inputs tried by hand: an argument naming a path outside the project (`--x ../other`, said
nothing), a missing one (`--data-dir nothere`, nothing), `--data-dir=data` (said), a default
rule (`.venv/`, named: said with "gpuctl's default"), a rule in a nested .gitignore."""

from __future__ import annotations

import json

from tests.conftest import QUICK_TRAIN

MB = 1 << 20


def big(path, mb: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * int(mb * MB))


def left_out_lines(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if "left out" in line]


def test_a_directory_the_arguments_name_is_said_with_its_rule(gpuctl, make_project):
    proj = make_project("p", {"train.py": QUICK_TRAIN, ".gitignore": "# data stays local\n*.log\ndata/\n"})
    big(proj / "data" / "x.bin", 0.1)
    gpuctl("up", "-y")
    res = gpuctl("train", proj, "--wait", "--", "--epochs", "1", "--data-dir", "data")
    (line,) = left_out_lines(res)
    assert "data/ (104.9 KB)" in line and ".gitignore line 3 `data/`" in line, line
    assert "--data" in line and "`!data/` to .gpuctlignore" in line, line
    # `--flag=value` names it too; re-included by .gpuctlignore, nothing is said.
    res = gpuctl("train", proj, "--wait", "--", "--epochs", "1", "--data-dir=data/")
    assert len(left_out_lines(res)) == 1
    (proj / ".gpuctlignore").write_text("!data/\n")
    assert left_out_lines(gpuctl("train", proj, "--wait", "--", "--epochs", "1", "--data-dir", "data")) == []


def test_more_than_a_few_mb_left_out_is_said_and_small_ones_are_not(gpuctl, make_project):
    proj = make_project("q", {"train.py": QUICK_TRAIN, ".gitignore": "*.h5\n", "sub/.gitignore": "/raw\n"})
    big(proj / "model.h5", 1)
    big(proj / ".venv" / "lib.so", 8)  # gpuctl's own default: never worth a word unless named
    gpuctl("up", "-y")
    assert left_out_lines(gpuctl("train", proj, "--wait")) == []
    big(proj / "sub" / "raw" / "a.bin", 6)
    (line,) = left_out_lines(gpuctl("train", proj, "--wait"))
    assert "left out 7.3 MB" in line and "sub/raw/ (6.3 MB, sub/.gitignore line 1 `/raw`)" in line, line
    assert "model.h5 (1.0 MB, .gitignore line 1 `*.h5`)" in line, line
    # `gpuctl sync` pushes the same way, and says the same.
    (line,) = left_out_lines(gpuctl("sync", proj))
    assert "sub/raw/" in line


def test_the_data_push_says_what_the_data_dirs_own_rules_leave_out(gpuctl, make_project, tmp_path):
    proj = make_project("d", {"train.py": QUICK_TRAIN})
    data = tmp_path / "data"
    big(data / "train" / "a.bin", 0.01)
    (data / ".gitignore").write_text("*\n!.gitignore\n")  # DVC's and many a data set's own: keep it out of git
    gpuctl("up", "-y")
    res = gpuctl("train", proj, "--data", data, "--wait")
    (line,) = left_out_lines(res)
    assert line.strip().startswith("data: left out train/ (10.5 KB) by .gitignore line 1 `*`: add `!*`"), line


def test_no_usable_tensorflow_is_refused_before_the_data_is_pushed(gpuctl, ssh, make_project, monkeypatch, tmp_path):
    from tests.integration.test_ssh import error_line, up_ssh

    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/usr/bin/python3")  # no TensorFlow there
    up_ssh(gpuctl, ssh)
    proj = make_project("p", {"train.py": "print(1)\n"})
    big(tmp_path / "data" / "a.bin", 2)
    res = gpuctl("train", proj, "--data", tmp_path / "data", code=7)
    assert "TensorFlow is not usable by /" in error_line(res)
    assert not [line for line in res.stderr.splitlines() if "data:" in line or "code:" in line], res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []
