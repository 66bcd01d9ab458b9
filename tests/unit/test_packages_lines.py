"""How a project's requirements file is read before pip sees it (payloads/gpuctl_packages.py):
TensorFlow kept, any other TensorFlow or Keras refused naming the line, options that reach past
the file refused, versions compared as PEP 440 does."""

from __future__ import annotations

import pytest

from gpuctl.payloads.gpuctl_packages import admits, check, constraints, logical_lines

HAVE = {"tensorflow-cpu": "2.21.0", "keras": "3.15.1", "tf-keras": "2.21.0"}


@pytest.mark.parametrize("op, version, installed, fits", [
    ("==", "2.21", "2.21.0", True), ("==", "2.21.*", "2.21.3", True), ("==", "2.15.*", "2.21.0", False),
    (">=", "2.16", "2.21.0", True), ("<", "2.21", "2.21.0", False), ("~=", "2.21.0", "2.21.4", True),
    ("~=", "2.20", "2.21.0", True), ("~=", "2.20.0", "2.21.0", False), ("!=", "2.21.0", "2.21.0", False),
    ("<", "2.21.0", "2.21.0rc1", True), (">", "2.21.0", "2.21.0.post1", True), ("==", "x.y", "2.21.0", None),
])
def test_versions(op, version, installed, fits):
    assert admits(op, version, installed) is fits


def test_tensorflow_lines_that_match_are_kept_from_pip():
    refused, passed, notes = check("tensorflow>=2.16,<3\ntqdm\nkeras>=3\n", HAVE)
    assert refused is None and passed == ["tqdm", "keras>=3"]
    assert notes == ["line 1 (tensorflow>=2.16,<3): the cluster's TensorFlow 2.21.0 is kept"]


@pytest.mark.parametrize("text, why", [
    ("tqdm\n# a comment\n\ntensorflow-gpu==2.15.0 \\\n  --hash=sha256:00\n",
     "line 4 (tensorflow-gpu==2.15.0 --hash=sha256:00) asks for another TensorFlow than the cluster's TensorFlow 2.21.0"),
    ("tf-keras<2.16\n", "line 1 (tf-keras<2.16) asks for another tf-keras than the cluster's tf-keras 2.21.0"),
    ("tf-nightly @ https://example.invalid/tf.whl\n", "comes from the cluster here (2.21.0), not from a URL"),
    ("-r other.txt\n", "line 1 (-r other.txt): the option -r is not taken here"),
    ("--trusted-host=evil\n", "the option --trusted-host is not taken here"),
    ("./vendored/pkg\n", "not a package this can read"),
    ("git+https://example.invalid/x.git\n", "not a package this can read"),
    ("tensorflow==two\n", "cannot read the version in '==two'"),
])
def test_refused_lines(text, why):
    refused, passed, _ = check(text, HAVE)
    assert refused is not None and why in refused and passed == []


def test_no_tensorflow_here_refuses_any_tensorflow_line():
    refused, _, _ = check("tensorflow\n", {})
    assert refused is not None and "has no TensorFlow to keep" in refused
    assert check("keras==3.5\n", {})[1] == ["keras==3.5"]  # no Keras here: the project's to install


def test_constraints_pin_what_is_here_and_bar_the_rest():
    pins = constraints(HAVE)
    assert "tensorflow-cpu==2.21.0" in pins and "tensorflow<0" in pins and "keras==3.15.1" in pins


def test_lines_join_and_lose_comments():
    assert logical_lines("a  # x\n#b\nc \\\n d\n\ne#f\n") == [(1, "a"), (3, "c   d"), (6, "e#f")]
