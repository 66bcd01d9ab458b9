"""A fake provider and a fake host, so the use cases in gpuctl.ops can be tested without the CLI,
tmux or SSH. They keep everything in memory and record what they were asked; the real providers
and hosts are tested on real parts (tests/integration)."""

from __future__ import annotations

import posixpath
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from gpuctl.model.records import CommandResult, InstanceRecord, PriceQuote, Resource, SyncStats
from gpuctl.model.specs import ClusterSpec, RemoteSpec


class FakeHost:
    """Files in a dict; every command but tmux answers 0 unless `answers` says otherwise."""

    local = False
    tmux_socket = "fake"
    python = "python3"

    def __init__(self, root: str = "/fake"):
        self.root = root
        self.label = "fake-host"
        self.files: dict[str, bytes] = {}
        self.commands: list[tuple[str, ...]] = []
        # first argv word -> result; tmux's as on a host where it never ran (no session of any name)
        self.answers: dict[str, CommandResult] = {"tmux": CommandResult(
            argv=("tmux",), returncode=1, stdout="", stderr="no server running on /tmp/tmux-0/fake\n")}
        self.on_run: Callable[[tuple[str, ...]], None] | None = None  # what a command does there
        self.closed = False

    def run(self, argv, check=True, timeout=None, **_: Any) -> CommandResult:
        self.commands.append(tuple(argv))
        if self.on_run is not None:
            self.on_run(tuple(argv))
        return self.answers.get(argv[0], CommandResult(argv=tuple(argv), returncode=0, stdout="", stderr=""))

    def read_bytes(self, path: str, offset: int = 0, limit: int = 8 << 20) -> bytes | None:
        data = self.files.get(path)
        if data is None:
            return None
        start = max(0, len(data) + offset) if offset < 0 else offset
        return data[start:start + limit]

    def file_size(self, path: str) -> int | None:
        return len(self.files[path]) if path in self.files else None

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.files[path] = text.encode()

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[path] = data

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        n = 0
        for f in Path(src).rglob("*"):
            if f.is_file():
                self.files[posixpath.join(dest, f.relative_to(src).as_posix())] = f.read_bytes()
                n += 1
        return SyncStats(files_total=n, files_copied=n, bytes_copied=0, files_deleted=0, seconds=0.0)

    def remove_tree(self, path: str) -> None:
        for key in [k for k in self.files if k.startswith(path.rstrip("/") + "/")]:
            del self.files[key]

    def pull_tree(self, path: str, local: Path) -> int:
        return 0

    def interactive(self, command, tty=True):
        return ["fake-ssh", command or "login"], None

    def forward(self, local_port, remote_port):
        return ["fake-forward", str(local_port), str(remote_port)]

    def close(self) -> None:
        self.closed = True


class FakeProvider:
    """A cloud that launches instantly; `world` is shared by every instance of the class so a
    test can end instances or make launches fail, as a cloud would."""

    name = "fake"
    reuses_live_clusters = False
    arms_guard_at_up = False
    default_on_fire = "poweroff"
    boot_hard_cap = False
    world: dict[str, Any] = {}

    def __init__(self, home: Path, spec: ClusterSpec):
        self.home, self.spec = home, spec

    @classmethod
    def reset(cls) -> None:
        cls.world = {"instances": {}, "hosts": {}, "fail_launch": None, "leave_on_failure": False, "ended": {},
                     "interrupted": set()}

    @classmethod
    def spec_from_settings(cls, settings, usd_per_hour=None) -> ClusterSpec:
        # A Python set, as on a host whose TensorFlow the user names: the setup step is not these tests' subject.
        return ClusterSpec(name=settings.cluster, provider="fake", usd_per_hour=usd_per_hour or 36.0,
                           launch_token=secrets.token_hex(4), remote=RemoteSpec(python="python3"))

    def check(self) -> None:
        if self.world.get("refuse"):
            raise self.world["refuse"]

    def launch_question(self) -> str | None:
        return "rent a fake machine"

    def price_quote(self) -> PriceQuote:
        return PriceQuote(usd_per_hour=self.spec.usd_per_hour, source="the fake's price")

    def launch(self, progress, wait_ssh=True, launched=lambda _: None) -> list[InstanceRecord]:
        if self.world.get("on_launch"):  # what another command does while this launch waits
            self.world["on_launch"]()
        if self.world["leave_on_failure"]:
            self.world["instances"][f"left-{self.spec.name}"] = self.spec.name
        if self.world["fail_launch"]:
            raise self.world["fail_launch"]
        iid = f"f-{secrets.token_hex(3)}"
        self.world["instances"][iid] = self.spec.name
        progress(f"launched {iid}")
        return [InstanceRecord(id=iid, cluster=self.spec.name, state="running", launched_at=time.time(),
                               workdir="/fake", usd_per_hour=self.spec.usd_per_hour, ssh_user="me", public_ip="192.0.2.1")]

    def remember(self, instances) -> None:
        pass

    def host(self, instance: InstanceRecord, connect_timeout_s=None, progress=None) -> FakeHost:
        return self.world["hosts"].setdefault(instance.id, FakeHost())

    def reconcile(self, instances):
        if self.world.get("unreachable"):
            raise self.world["unreachable"]
        ended = self.world["ended"]
        return [i.model_copy(update={"state": "terminated", "terminated_at": ended[i.id], "state_reason": "fake end"})
                if i.id in ended else i for i in instances]

    def discover(self, cluster=None, region=None) -> list[Resource]:
        return [Resource(provider="fake", kind="instance", id=i, cluster=c)
                for i, c in self.world["instances"].items() if cluster in (None, c)]

    def release(self, resources, progress, unreachable=frozenset()) -> None:
        for r in resources:
            self.world["instances"].pop(r.id, None)

    def set_hard_cap(self, host, hours) -> bool:
        return False

    def checkpoint_store(self) -> None:
        return None

    def interruption_notice(self) -> None:
        return None

    def was_interrupted(self, instance) -> bool:
        return instance.id in self.world["interrupted"] and instance.state == "terminated"
