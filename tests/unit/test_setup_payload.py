"""The setup payload's decisions, run as the instance runs them (stdlib, real subprocesses):
which installed TensorFlow counts as the asked version, what pip is asked for, and what the
probe reports for an image that has its own TensorFlow (a DLAMI's /opt/tensorflow). The install
itself runs for real in tests/integration/test_setup_step.py."""

from __future__ import annotations

import json
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
    assert setup.requirements("2.21.0", "cpu") == [["tensorflow-cpu==2.21.0", "tensorboard"],
                                                   ["--no-deps", "tf-keras==2.21.0"]]


def test_the_probe_finds_an_images_own_tensorflow_of_that_version(tmp_path):
    dlami = tmp_path / "opt" / "tensorflow" / "bin" / "python3"
    dlami.parent.mkdir(parents=True)
    dlami.write_text("#!/bin/sh\necho 2.18.0\n")  # answers the version question as a DLAMI's Python would
    dlami.chmod(0o755)

    def probe(version):
        out = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = ['x', 'probe', '--root', {str(tmp_path / 'w')!r}, "
                              f"'--tensorflow', {version!r}]; from gpuctl.payloads import gpuctl_setup as s; "
                              f"s.CANDIDATES = ({str(dlami)!r},); s.main()"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    seen = probe("2.18")
    assert seen["found"] == [{"python": str(dlami), "tensorflow": "2.18.0"}] and seen["ready"] is None
    assert seen["env"] == str(tmp_path / "w" / "_envs" / "tf-2.18") and seen["installing"] is False
    other = probe("2.21")
    assert other["found"] == [] and other["others"] == [{"python": str(dlami), "tensorflow": "2.18.0"}]


def test_a_version_that_is_no_version_never_becomes_a_path(tmp_path):
    root = tmp_path / "root"
    res = subprocess.run([sys.executable, PAYLOAD, "install", "--root", str(root), "--tensorflow", "../../etc"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "must look like 2.21" in res.stderr
    assert not root.exists()
