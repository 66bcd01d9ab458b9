"""The setup payload's decisions, run as the instance runs them (stdlib, real subprocesses):
which installed TensorFlow counts as the asked version, what pip is asked for, and what the
probe reports for an image that has its own TensorFlow (a DLAMI's /opt/tensorflow). The install
itself runs for real in tests/integration/test_setup_step.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuctl.payloads import gpuctl_setup as setup

PAYLOAD = setup.__file__


@pytest.mark.parametrize("found, asked, ok", [
    ("2.21.0", "2.21", True), ("2.21.3", "2.21", True), ("2.21.0", "2.21.0", True),
    ("2.210.0", "2.21", False), ("2.2.1", "2.21", False), ("2.21.1", "2.21.0", False), (None, "2.21", False),
])
def test_which_installed_version_counts_as_the_asked_one(found, asked, ok):
    assert setup.matches(found, asked) is ok


def test_what_pip_is_asked_for():
    assert setup.requirements("2.21", "cuda") == [["tensorflow[and-cuda]==2.21.*", "tf-keras==2.21.*", "tensorboard"]]
    # Without a GPU: the CPU build, and tf-keras without the full build it would drag in.
    # tf-keras numbers its patches apart from TensorFlow's (2.20.1 for TF 2.20.0): same minor.
    assert setup.requirements("2.21.0", "cpu") == [["tensorflow-cpu==2.21.0", "tensorboard"],
                                                   ["--no-deps", "tf-keras==2.21.*"]]


def test_the_probe_finds_an_images_own_tensorflow_of_that_version(tmp_path):
    dlami = tmp_path / "opt" / "tensorflow" / "bin" / "python3"
    dlami.parent.mkdir(parents=True)
    dlami.write_text("#!/bin/sh\necho 2.18.0\n")  # answers the version question as a DLAMI's Python would
    dlami.chmod(0o755)
    # The probe also asks the host's python3 (shutil.which): this test's PATH holds one without
    # TensorFlow, whatever the caller's PATH holds (a Python with TensorFlow there was found too).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}

    def probe(version):
        out = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = ['x', 'probe', '--root', {str(tmp_path / 'w')!r}, "
                              f"'--tensorflow', {version!r}]; from gpuctl.payloads import gpuctl_setup as s; "
                              f"s.CANDIDATES = ({str(dlami)!r},); s.main()"], capture_output=True, text=True, check=True,
                             env=env)
        return json.loads(out.stdout)

    seen = probe("2.18")
    assert seen["found"] == [{"python": str(dlami), "tensorflow": "2.18.0"}] and seen["ready"] is None
    assert seen["env"] == str(tmp_path / "w" / "_envs" / "tf-2.18") and seen["installing"] is False
    other = probe("2.21")
    assert other["found"] == [] and {"python": str(dlami), "tensorflow": "2.18.0"} in other["others"]


def test_a_ready_env_of_another_spelling_of_the_version_serves(tmp_path):
    """An image baked for "2.21.0" serves `--tf 2.21`, and the reverse; "2.20" never serves "2.21"."""
    envs = tmp_path / "_envs"
    for name, version in (("tf-2.21.0", "2.21.0"), ("tf-2.20", "2.20.1")):
        (envs / name / "bin").mkdir(parents=True)
        (envs / name / "bin" / "python").write_text("#!/bin/sh\n")
        (envs / name / "bin" / "python").chmod(0o755)
        (envs / name / setup.MARKER).write_text(json.dumps({"tensorflow": version}))
    env, marker = setup.ready_env(setup.paths(str(tmp_path), "2.21"), "2.21")
    assert env == str(envs / "tf-2.21.0") and marker["tensorflow"] == "2.21.0"
    assert setup.ready_env(setup.paths(str(tmp_path), "2.19"), "2.19") == (None, None)
    (envs / "tf-2.21.0" / setup.MARKER).write_text("[1, 2]")  # a marker that is not gpuctl's
    assert setup.ready_env(setup.paths(str(tmp_path), "2.21"), "2.21") == (None, None)


def test_the_probes_answer_is_checked_before_use():
    from gpuctl.remote.tf_env import _unreadable

    good = {"env": "/w/_envs/tf-2.21", "python": "/w/_envs/tf-2.21.0/bin/python", "log": "/w/_envs/tf-2.21.log",
            "log_size": 0, "ready": None, "found": [{"python": "/opt/tensorflow/bin/python3", "tensorflow": "2.21.0"}],
            "others": [], "system_version": "3.10"}
    assert _unreadable(good, "2.21") is None
    for bad in ({"env": "/etc"}, {"python": "/usr/bin/evil"}, {"python": "relative/bin/python"},
                {"log_size": "12"}, {"ready": "yes"}, {"found": [{"python": "/x", "tensorflow": "\x1b[2J"}]},
                {"others": "none"}, {"system_version": "3.10\n"}):
        assert _unreadable({**good, **bad}, "2.21") == next(iter(bad)).split("_size")[0], bad
    assert _unreadable([1], "2.21") == "not an object"


def test_a_version_that_is_no_version_never_becomes_a_path(tmp_path):
    root = tmp_path / "root"
    res = subprocess.run([sys.executable, PAYLOAD, "install", "--root", str(root), "--tensorflow", "../../etc"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "must look like 2.21" in res.stderr
    assert not root.exists()
