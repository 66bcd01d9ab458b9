"""Issue 35 §4: a command's output comes back bounded (its last MAX_OUTPUT bytes of each stream, the
rest read, discarded and counted), on this machine as the instance (real processes); the GPU
count's nvidia-smi is a probe that may hang without the host counting as hung. (Over SSH:
tests/integration/test_instance_bounds.py.)"""

from __future__ import annotations

import os
import time

import pytest

from gpuctl.errors import RemoteTimeout
from gpuctl.ops import queue
from gpuctl.remote.host import MAX_OUTPUT
from gpuctl.remote.local import LocalHost

MB = 1 << 20


def fake_nvidia_smi(tmp_path, monkeypatch, body: str) -> None:
    """nvidia-smi on PATH as a shell script: no GPU can exist on these test machines (the one mock)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + body + "\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_400_mb_printed_comes_back_as_its_tail_and_a_count(tmp_path):
    host = LocalHost(tmp_path)
    res = host.run(["sh", "-c", "yes 0123456789abcdef | head -c 419430400; echo; echo last line; "
                    "yes e | head -c 3000000 >&2; echo err end >&2"])
    assert len(res.stdout) <= MAX_OUTPUT and res.stdout.endswith("\nlast line\n")
    assert len(res.stderr) <= MAX_OUTPUT and res.stderr.endswith("e\nerr end\n")
    assert res.dropped == 400 * MB + 11 + 3000000 + 8 - len(res.stdout) - len(res.stderr)


def test_a_caller_may_ask_for_all_of_it(tmp_path):
    res = LocalHost(tmp_path).run(["head", "-c", str(3 * MB), "/dev/zero"], output_limit=None)
    assert len(res.stdout) == 3 * MB and res.dropped == 0


def test_a_command_that_never_stops_printing_is_cut_at_its_deadline(tmp_path):
    host = LocalHost(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout):
        host.run(["yes"], timeout=1)
    assert time.monotonic() - t0 < 10


class Keeping(LocalHost):
    """This machine as the host, keeping what its commands answered."""

    def __init__(self, root):
        super().__init__(root)
        self.answers = []

    def run(self, argv, *args, **kw):
        self.answers.append(super().run(argv, *args, **kw))
        return self.answers[-1]


def test_nvidia_smi_printing_400_mb_counts_what_it_lists_in_bounded_memory(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, 'yes "GPU 0: Fake (UUID: a)" | head -c 419430400')
    host = Keeping(tmp_path)
    assert queue.gpus_of(host) == queue.MAX_GPUS
    assert len(host.answers[0].stdout) <= MAX_OUTPUT and host.answers[0].dropped == 399 * MB


def test_a_hanging_nvidia_smi_is_gpus_unknown_and_the_host_still_answers(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "sleep 600")
    host = LocalHost(tmp_path, command_timeout_s=30)
    monkeypatch.setattr(queue, "PROBE_S", 1.0)
    t0 = time.monotonic()
    notes: list[str] = []
    assert queue.gpus_of(host, notes.append) == 0
    assert time.monotonic() - t0 < 10
    assert notes and "nvidia-smi" in notes[0] and "did not answer" in notes[0]
    assert host.hung is None and host.run(["true"]).returncode == 0
