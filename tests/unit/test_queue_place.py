"""A run's place in the cluster's queue, read back from the instance (untrusted): bounded."""

from __future__ import annotations

import json

import pytest

from gpuctl.cli.render.cost import ordinal
from gpuctl.errors import ConfigError
from gpuctl.ops import queue
from gpuctl.remote.local import LocalHost


def place(tmp_path, data) -> dict | None:
    (tmp_path / "queue.json").write_text(data if isinstance(data, str) else json.dumps(data))
    return queue.look(LocalHost(tmp_path), str(tmp_path))


def test_a_believable_place_is_read(tmp_path):
    got = place(tmp_path, {"state": "running", "share": 0.5, "queued_at": 1000.0, "started_at": 1010.0})
    assert got == {"state": "running", "share": 0.5, "queued_at": 1000.0, "started_at": 1010.0, "waited_s": 10.0}


@pytest.mark.parametrize("data", ["not json", "[1, 2]", {"state": "\x1b[2Jrunning"}, "x" * 70000])
def test_what_is_not_a_place_is_none(tmp_path, data):
    assert place(tmp_path, data) is None


def test_out_of_bounds_values_are_dropped(tmp_path):
    got = place(tmp_path, {"state": "queued", "position": 10**9, "share": 7.0, "queued_at": -5, "started_at": True})
    assert got == {"state": "queued"}
    got = place(tmp_path, {"state": "running", "queued_at": 2000.0, "started_at": 1000.0})
    assert got["waited_s"] == 0.0  # a start before the queueing is not believed


def test_gpus_asked_are_checked():
    assert queue.asked(None, 0, 1) == 1 and queue.asked(None, 4, 1) == 4 and queue.asked(2, 4, 1) == 2
    for flag, gpus, nodes in ((5, 4, 1), (0, 4, 1), (2, 0, 1), (2, 4, 2)):
        with pytest.raises(ConfigError):
            queue.asked(flag, gpus, nodes)


def test_ordinals():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]
