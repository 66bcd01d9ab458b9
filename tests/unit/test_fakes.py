"""The fakes the use-case tests drive (tests/fakes.py) answer only what a test scripted: an
unscripted command fails the test, naming the command, where it used to answer success (and a
test then passed whatever the code asked). mypy checks they implement the protocols they stand in
for (tests/unit/test_types.py)."""

from __future__ import annotations

import pytest

from gpuctl.errors import RemoteError, RemoteTimeout
from tests.fakes import FakeHost, Unscripted


def test_an_unscripted_command_fails_loudly_naming_it():
    host = FakeHost()
    with pytest.raises(Unscripted, match=r"unscripted command uptime -p"):
        host.run(["uptime", "-p"], check=False)
    assert host.unscripted == [("uptime", "-p")]  # kept, for a fixture to fail a test whose code caught it


def test_a_scripted_command_answers_and_a_failure_raises_as_a_real_host_does():
    host = FakeHost()
    host.script("nproc", stdout="8\n")
    host.script("false", returncode=1, stderr="no\n")
    assert host.run(["nproc"]).stdout == "8\n"
    assert host.run(["false"], check=False).returncode == 1
    with pytest.raises(RemoteError, match="exit 1"):
        host.run(["false"])


def test_pull_tree_answers_the_contracts_tuple(tmp_path):
    host = FakeHost()
    host.files["/fake/runs/r/outputs/model.txt"] = b"weights"
    assert host.pull_tree("/fake/runs/r", tmp_path) == (1, ())
    assert (tmp_path / "outputs" / "model.txt").read_bytes() == b"weights"


def test_a_hung_fake_host_is_not_asked_again():
    host = FakeHost()
    host.script("true")
    host.timed_out("a look", 5.0)
    with pytest.raises(RemoteTimeout):
        host.run(["true"])
