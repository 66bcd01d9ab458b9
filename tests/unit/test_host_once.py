"""What one command asks of a host connection once (remote/host.py `once`): the payload push and
the GPU count, which `train` asked for two or three times, each an SSH round trip."""

from __future__ import annotations

import gc
import weakref

from gpuctl.ops import guards, queue
from gpuctl.remote import host as host_mod
from gpuctl.remote.host import once
from gpuctl.remote.local import LocalHost


class Counting(LocalHost):
    """This machine as the host, counting what crosses to it."""

    def __init__(self, root):
        super().__init__(root)
        self.pushes = self.runs = 0

    def push(self, src, dest, progress=None):
        self.pushes += 1
        return super().push(src, dest, progress)

    def run(self, argv, check=True, timeout=None, **kw):
        self.runs += 1
        return super().run(argv, check, timeout, **kw)


def test_the_payload_is_pushed_once_per_connection(tmp_path):
    host = Counting(tmp_path / "root")
    for _ in range(3):  # setup, launch_job and guards.install each ask
        assert guards.push_payload(host) == str(tmp_path / "root" / "payload")
    assert host.pushes == 1 and (tmp_path / "root" / "payload" / "gpuctl_run.py").is_file()


def test_the_next_command_pushes_the_payload_only_where_the_hosts_files_differ(tmp_path):
    """A new connection (the next command) hashes the files there (`cat | sha1sum`, one command)
    instead of an rsync connection; a file changed or gone there is pushed again."""
    payload = tmp_path / "root" / "payload"
    guards.push_payload(Counting(tmp_path / "root"))
    same = Counting(tmp_path / "root")
    guards.push_payload(same)
    assert same.pushes == 0 and same.runs == 1
    same_size = b"#" * (payload / "gpuctl_queue.py").stat().st_size  # the local copy's manifest alone misses it
    for harm in (lambda: (payload / "gpuctl_watchdog.py").write_text("# an older gpuctl's\n"),
                 lambda: (payload / "gpuctl_report.py").unlink(),
                 lambda: (payload / "gpuctl_run.py").write_bytes(b""),
                 lambda: (payload / "gpuctl_queue.py").write_bytes(same_size)):
        harm()
        changed = Counting(tmp_path / "root")
        guards.push_payload(changed)
        assert changed.pushes == 1
        for f in guards.PAYLOAD_DIR.glob("*.py"):
            assert (payload / f.name).read_bytes() == f.read_bytes()


def test_the_gpus_are_counted_once_per_connection(tmp_path):
    host = Counting(tmp_path)
    assert queue.gpus_of(host) == queue.gpus_of(host)
    assert host.runs <= 1  # nvidia-smi -L once (none at all where it is not installed)


def test_a_closed_connection_is_forgotten():
    calls = []
    box = Counting("/nonexistent")
    once(box, "x", lambda: calls.append(1) or 7)
    assert once(box, "x", lambda: calls.append(1) or 8) == 7 and calls == [1]
    gone = weakref.ref(box)
    assert box in host_mod._ONCE
    del box
    gc.collect()
    # The facts hold no reference to their connection (counting _ONCE's entries raced with other
    # tests' hosts that the same collection freed).
    assert gone() is None
