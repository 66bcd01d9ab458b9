"""A fake provider and a fake host, so the use cases in gpuctl.ops can be tested without the CLI,
tmux or SSH. They keep everything in memory, record what they were asked, answer only what a test
scripted, and implement the protocols they stand in for (mypy checks them: scripts/typecheck); the
real providers and hosts are tested on real parts (tests/integration)."""

from __future__ import annotations

import posixpath
import secrets
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn, Sequence

from gpuctl.errors import ConfigError
from gpuctl.model.records import CommandResult, InstanceRecord, PriceQuote, Resource, SyncStats
from gpuctl.model.specs import Capabilities, ClusterSpec, RemoteSpec, RunFiles
from gpuctl.model.untrusted import MAX_READ
from gpuctl.provision import MachinesThatStay, Provider, ignore_launched
from gpuctl.remote.host import MAX_OUTPUT, Deadlines, Host, check_result

if TYPE_CHECKING:
    from gpuctl.config.settings import Settings


Answer = CommandResult | Callable[[tuple[str, ...]], CommandResult]


class Unscripted(AssertionError):
    """A command a test did not script: the fake does not guess an answer (a guessed success is how
    a test passes whatever the code asked)."""


class FakeHost(Deadlines):
    """Files in a dict; a command answers what `answers` says for its first word (a result, or a
    function of the argv), and nothing else: an unscripted command raises Unscripted, naming it,
    and is kept in `unscripted` (the fixtures fail a test that left any, in case code caught it)."""

    local = False
    tmux_socket = "fake"
    python = "python3"

    def __init__(self, root: str = "/fake"):
        self.root = root
        self.label = "fake-host"
        self.files: dict[str, bytes] = {}
        self.commands: list[tuple[str, ...]] = []
        self.unscripted: list[tuple[str, ...]] = []
        # first argv word -> its answer; tmux's as on a host where it never ran (no session of any name)
        self.answers: dict[str, Answer] = {"tmux": CommandResult(
            argv=("tmux",), returncode=1, stdout="", stderr="no server running on /tmp/tmux-0/fake\n")}
        self.on_run: Callable[[tuple[str, ...]], None] | None = None  # what a command does there
        self.closed = False

    def script(self, word: str, returncode: int = 0, stdout: str = "", stderr: str = "") -> None:
        """What every command whose first word is `word` answers from now on."""
        self.answers[word] = CommandResult(argv=(word,), returncode=returncode, stdout=stdout, stderr=stderr)

    def run(self, argv: Sequence[str], check: bool = True, timeout: float | None = None,
            cwd: bool = True, output_limit: int | None = MAX_OUTPUT, probe: bool = False) -> CommandResult:
        cmd = tuple(argv)
        self.deadline(timeout)  # a host that hung fails here, as the real ones do
        self.commands.append(cmd)
        if self.on_run is not None:
            self.on_run(cmd)
        answer = self.answers.get(cmd[0])
        try:
            if answer is None:
                raise Unscripted(f"unscripted command {shlex.join(cmd)} (script it: host.answers[{cmd[0]!r}])")
            res = answer(cmd) if callable(answer) else answer.model_copy(update={"argv": cmd})
        except Unscripted as exc:
            self.unscripted.append(cmd)
            raise Unscripted(f"{self.label}: {exc}") from None
        return check_result(res, self.label) if check else res

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_READ) -> bytes | None:
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

    def write_chunks(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        self.files[path] = b"".join(chunks)

    def push(self, src: Path, dest: str, progress: Callable[[str], None] | None = None) -> SyncStats:
        n = 0
        for f in Path(src).rglob("*"):
            if f.is_file():
                self.files[posixpath.join(dest, f.relative_to(src).as_posix())] = f.read_bytes()
                n += 1
        return SyncStats(files_total=n, files_copied=n, bytes_copied=0, files_deleted=0, seconds=0.0)

    def link_tree(self, src: str, dest: str) -> None:
        prefix = src.rstrip("/") + "/"
        for key in [k for k in self.files if k.startswith(prefix)]:
            self.files[posixpath.join(dest, key[len(prefix):])] = self.files[key]

    def remove_tree(self, path: str) -> None:
        for key in [k for k in self.files if k.startswith(path.rstrip("/") + "/")]:
            del self.files[key]

    def pull_tree(self, path: str, local: Path, leave_out: tuple[str, ...] = ()) -> tuple[int, tuple[str, ...]]:
        """The files under `path` written below `local`, but for the top entries in `leave_out`:
        (how many, nothing skipped)."""
        prefix = path.rstrip("/") + "/"
        kept = {k[len(prefix):]: v for k, v in self.files.items()
                if k.startswith(prefix) and k[len(prefix):].split("/")[0] not in leave_out}
        for rel, data in kept.items():
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(data)
        return len(kept), ()

    def interactive(self, command: str | None, tty: bool = True) -> tuple[list[str], str | None]:
        return ["fake-ssh", command or "login"], None

    def forward(self, local_port: int, remote_port: int) -> list[str] | None:
        return ["fake-forward", str(local_port), str(remote_port)]

    def close(self) -> None:
        self.closed = True


def _done(cmd: tuple[str, ...], stdout: str = "") -> CommandResult:
    return CommandResult(argv=cmd, returncode=0, stdout=stdout, stderr="")


def _up_sh(cmd: tuple[str, ...]) -> CommandResult:
    """The shell lines `up` sends a new machine, answered as a fresh one would; any other raises."""
    line = shlex.join(cmd)
    if "sha1sum" in line and "/payload " in line:
        return _done(cmd)  # no payload there yet (no hash): it is pushed
    if "setsid nohup" in line and "gpuctl_preflight.py" in line:
        return _done(cmd, "4243\n")  # the preflight, started in the background: its pid
    raise Unscripted(f"unscripted shell line {line}")


def _up_rm(cmd: tuple[str, ...]) -> CommandResult:
    if cmd[:2] == ("rm", "-f") and cmd[-1].endswith("/.payload.gpuctl-manifest"):
        return _done(cmd)  # the payload's push forgets its manifest first
    raise Unscripted(f"unscripted rm {shlex.join(cmd)}")


# What a machine the fake provider hands out answers: the commands `up` sends it.
UP_ANSWERS: dict[str, Answer] = {"sh": _up_sh, "rm": _up_rm}


def unscripted(world: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every command a fake host of `world` was asked without a script (a test's teardown checks none)."""
    return [cmd for host in world.get("hosts", {}).values() for cmd in host.unscripted]


class FakeProvider(MachinesThatStay):
    """A cloud that launches instantly; `world` is shared by every instance of the class so a
    test can end instances or make launches fail, as a cloud would."""

    name = "fake"
    capabilities = Capabilities(default_on_fire="poweroff")
    world: dict[str, Any] = {}

    def __init__(self, home: Path, spec: ClusterSpec):
        self.home, self.spec = home, spec

    @classmethod
    def reset(cls) -> None:
        cls.world = {"instances": {}, "hosts": {}, "fail_launch": None, "leave_on_failure": False, "ended": {},
                     "interrupted": set()}

    @classmethod
    def spec_from_settings(cls, settings: Settings, usd_per_hour: float | None = None) -> ClusterSpec:
        # A Python set, as on a host whose TensorFlow the user names: the setup step is not these tests' subject.
        return ClusterSpec(name=settings.cluster, provider="fake", usd_per_hour=usd_per_hour or 36.0,
                           launch_token=secrets.token_hex(4), remote=RemoteSpec(python="python3"))

    def check(self) -> None:
        if self.world.get("refuse"):
            raise self.world["refuse"]

    def volume_store(self) -> NoReturn:
        raise ConfigError("the fake provider has no volumes", "Use local, ssh or aws.")

    def mount_volume(self, host: Host) -> tuple[str, str]:
        raise ConfigError("the fake provider has no volumes", "Use local, ssh or aws.")

    def price_quote(self) -> PriceQuote:
        return PriceQuote(usd_per_hour=self.spec.usd_per_hour, source="the fake's price")

    def launch(self, progress: Callable[[str], None], wait_ssh: bool = True,
               launched: Callable[[InstanceRecord], None] = ignore_launched) -> list[InstanceRecord]:
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

    def host(self, instance: InstanceRecord, connect_timeout_s: float | None = None,
             progress: Callable[[str], None] | None = None) -> FakeHost:
        hosts: dict[str, FakeHost] = self.world["hosts"]
        if instance.id not in hosts:
            hosts[instance.id] = FakeHost()
            hosts[instance.id].answers.update(UP_ANSWERS)
        return hosts[instance.id]

    def reconcile(self, instances: list[InstanceRecord]) -> list[InstanceRecord]:
        if self.world.get("unreachable"):
            raise self.world["unreachable"]
        ended = self.world["ended"]
        return [i.model_copy(update={"state": "terminated", "terminated_at": ended[i.id], "state_reason": "fake end"})
                if i.id in ended else i for i in instances]

    def discover(self, cluster: str | None = None, region: str | None = None) -> list[Resource]:
        return [Resource(provider="fake", kind="instance", id=i, cluster=c)
                for i, c in self.world["instances"].items() if cluster in (None, c)]

    def release(self, resources: list[Resource], progress: Callable[[str], None],
                unreachable: frozenset[str] = frozenset()) -> None:
        for r in resources:
            self.world["instances"].pop(r.id, None)

    def set_hard_cap(self, host: Host, hours: float) -> bool:
        return False

    def run_files(self) -> RunFiles:
        return RunFiles(kept="on_hosts")  # as before: the tests here are not about runs lost with a machine

    def was_interrupted(self, instance: InstanceRecord) -> bool:
        return instance.id in self.world["interrupted"] and instance.state == "terminated"


# The fakes stand in for these protocols: mypy (scripts/typecheck) checks that they still do.
_host: Host = FakeHost()
_provider: type[Provider] = FakeProvider
