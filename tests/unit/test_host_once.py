"""What one command asks of a host once (the Session's NodeFacts, remote/host.py): the payload
push and the GPU count, which `train` asked for two or three times, each an SSH round trip; a
new command (a new Session) asks again, whatever an earlier one learnt."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from gpuctl.model.records import CommandResult, SyncStats
from gpuctl.ops import guards, queue
from gpuctl.ops.session import Session
from gpuctl.remote.local import LocalHost


class Counting(LocalHost):
    """This machine as the host, counting what crosses to it."""

    def __init__(self, root: Path | str) -> None:
        super().__init__(Path(root))
        self.pushes = self.runs = 0

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        self.pushes += 1
        return super().push(src, dest, progress)

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None,
            **kw: Any) -> CommandResult:
        self.runs += 1
        return super().run(argv, check, timeout, **kw)


def test_the_payload_is_pushed_once_per_command(tmp_path: Path) -> None:
    host, s = Counting(tmp_path / "root"), Session(tmp_path / "home", env={})
    for _ in range(3):  # setup, configure and guards.install each ask
        assert guards.push_payload(host, s.facts(host)) == str(tmp_path / "root" / "payload")
    assert host.pushes == 1 and (tmp_path / "root" / "payload" / "gpuctl_run.py").is_file()
    # The next command (its own Session) asks again over the same connection: the files there
    # may have changed between two commands; it checks their hash, and pushes nothing.
    again = Session(tmp_path / "home", env={})
    runs = host.runs
    guards.push_payload(host, again.facts(host))
    assert host.pushes == 1 and host.runs == runs + 1


def test_the_next_command_pushes_the_payload_only_where_the_hosts_files_differ(tmp_path: Path) -> None:
    """A new command hashes the files there (`cat | sha1sum`, one command) instead of an rsync
    connection; a file changed or gone there is pushed again."""
    payload = tmp_path / "root" / "payload"
    first = Counting(tmp_path / "root")
    guards.push_payload(first, Session(tmp_path / "home", env={}).facts(first))
    same = Counting(tmp_path / "root")
    guards.push_payload(same, Session(tmp_path / "home", env={}).facts(same))
    assert same.pushes == 0 and same.runs == 1
    same_size = b"#" * (payload / "gpuctl_queue.py").stat().st_size  # the local copy's manifest alone misses it
    for harm in (lambda: (payload / "gpuctl_watchdog.py").write_text("# an older gpuctl's\n"),
                 lambda: (payload / "gpuctl_report.py").unlink(),
                 lambda: (payload / "gpuctl_run.py").write_bytes(b""),
                 lambda: (payload / "gpuctl_queue.py").write_bytes(same_size)):
        harm()
        changed = Counting(tmp_path / "root")
        guards.push_payload(changed, Session(tmp_path / "home", env={}).facts(changed))
        assert changed.pushes == 1
        for f in guards.PAYLOAD_DIR.glob("*.py"):
            assert (payload / f.name).read_bytes() == f.read_bytes()


def test_the_gpus_are_counted_once_per_command(tmp_path: Path) -> None:
    host, s = Counting(tmp_path), Session(tmp_path / "home", env={})
    assert queue.gpus_of(host, facts=s.facts(host)) == queue.gpus_of(host, facts=s.facts(host))
    assert host.runs == 1  # nvidia-smi -L once (LocalHost counts a missing one as an answer too)
    queue.gpus_of(host, facts=Session(tmp_path / "home", env={}).facts(host))
    assert host.runs == 2  # another command asks anew


def test_a_sessions_facts_are_its_own_and_go_with_it(tmp_path: Path) -> None:
    host = Counting(tmp_path)
    s, other = Session(tmp_path / "home", env={}), Session(tmp_path / "home", env={})
    s.facts(host).python = "/opt/tf/bin/python"
    assert s.facts(host).python_of(host) == "/opt/tf/bin/python"
    assert other.facts(host).python_of(host) == host.python  # the host itself is never changed
    s.close()
    assert s.facts(host).python is None
