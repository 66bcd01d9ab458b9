"""One command's view of gpuctl: the home (ledger, keys, cluster files), the command's flags, and
the connections it opens. Every use case takes a Session first.

Settings are read only by the use cases that need them (`up`, `train`, `guard set`, `config
show`): everything done to an existing cluster works from the spec the ledger recorded at `up`,
so a broken settings file never stops `status`, `logs`, `cost` or `down`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar

from gpuctl.errors import (
    ConfigError,
    ConflictError,
    GpuctlError,
    NoClusterError,
    NotFoundError,
    RemoteError,
)
from gpuctl.ledger import Ledger
from gpuctl.ledger.schema import gpuctl_home
from gpuctl.model.records import ENDED_STATES, ClusterRecord, InstanceRecord, RunRecord
from gpuctl.model.specs import ClusterSpec
from gpuctl.provision import Provider, get_provider, spec_from_settings
from gpuctl.remote.heartbeat import Heartbeat
from gpuctl.remote.host import QUICK_CONNECT_S, Host, NodeFacts
from gpuctl.retry import REAL_CLOCK, Clock, TimedOut, poll

if TYPE_CHECKING:
    from gpuctl.config.load import LoadedSettings
    from gpuctl.config.project import Ignored

Progress = Callable[[str], None]
# status, cost, logs, guard show, pull, down: answer from the ledger (or refuse) rather than wait on a host
REPORT_CONNECT_TIMEOUT_S = QUICK_CONNECT_S
PROVIDER_KEPT_S = 300.0  # how long a command's provider serves it (Session.provider)


def quiet(_: str) -> None:
    pass


T = TypeVar("T")
R = TypeVar("R")

# How long the brake (`down`, `stop`) waits for another command that holds the cluster (a `train`
# starting a job finishes in well under this) before it goes ahead: one stopped with Ctrl-Z never lets go.
BRAKE_LOCK_S = 5.0


def each(items: Sequence[T], fn: Callable[[T], R]) -> list[R]:
    """fn on every item at once (a node, a host: one connection each), results in their order;
    a single one in the calling thread."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(fn, items))


def serialized(progress: Progress) -> Progress:
    """`progress` for several threads at once: one line at a time (the terminal's sink keeps the
    line it may erase; two threads' lines would interleave in it)."""
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            progress(line)
    return say


class Session:
    """The ledger, settings and open hosts of one command over one gpuctl home."""

    clock: Clock = REAL_CLOCK  # every wait of this command's use cases (a test drives its own)

    def __init__(self, home: Path, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        self.home = Path(home)
        self.flags: Mapping[str, Any] = dict(flags or {})
        self.env = os.environ if env is None else env
        self._ledger: Ledger | None = None
        self._hosts: dict[tuple[int, str], Host] = {}
        self._facts: dict[Host, NodeFacts] = {}  # what each host answered in this command
        self._settings: dict[str, LoadedSettings] = {}
        self._providers: dict[str, tuple[float, Provider]] = {}
        self.launch_specs: dict[float | None, ClusterSpec] = {}  # `up`'s, by the rate asked (ops/clusters.py)
        self._providers_lock = threading.Lock()
        # A first connection's wait (None: remote.connect_timeout_s); set by `connect_quickly` alone.
        self.connect_timeout_s: float | None = None
        self._unreachable: dict[int, GpuctlError] = {}  # cluster id -> why: asked once per command
        self.unreachable_ids: set[str] = set()  # instances that did not answer: not waited for again (down)
        # Hears a slow first connection while it waits (the CLI prints it on stderr).
        self.on_wait: Progress | None = None
        # What this command found on an instance and left out (a bad report line, a state file of
        # the wrong shape): each said once, in the report of the command that found it.
        self.notes: list[str] = []
        # Hears, once, what the project's gpuctl.toml asked for and did not get (the CLI prints it on stderr).
        self.on_ignored: Progress | None = None
        self._ignored_said: set[Ignored] = set()

    def connect_quickly(self) -> None:
        """A command that reports or ends (status, cost, logs, guard show, pull, down): a host
        silent for REPORT_CONNECT_TIMEOUT_S is said at once, not waited minutes for."""
        self.connect_timeout_s = self.connect_timeout_s or REPORT_CONNECT_TIMEOUT_S

    def facts(self, host: Host) -> NodeFacts:
        """What `host` answered in this command (its Python, GPUs, payload): asked once each."""
        return self._facts.setdefault(host, NodeFacts())  # one per host: setdefault is atomic (the GIL)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.home)
        return self._ledger

    def settings(self, project_dir: Path | None = None) -> LoadedSettings:
        """The settings for this command (cached: files and flags stay put while it runs)."""
        key = str(project_dir)  # files and flags are the same for the whole command
        if key not in self._settings:
            # Imported here: the settings' models are tens of classes that a report never reads.
            from gpuctl.config.load import load_settings
            from gpuctl.config.project import said

            self._settings[key] = load_settings(self.flags, project_dir=project_dir, env=self.env)
            # Said once per command, in one line, whichever of its loads met it first.
            fresh = [i for i in self._settings[key].ignored if i not in self._ignored_said]
            self._ignored_said.update(fresh)
            if fresh and self.on_ignored is not None:
                self.on_ignored(said(fresh))
        return self._settings[key]

    def provider(self, spec: ClusterSpec) -> Provider:
        """The provider of a cluster, built from the spec recorded at its `up`: one per spec for
        PROVIDER_KEPT_S of the command, so that what it opened serves the command's steps (aws: a
        boto3 session per region, its clients, and the catalog it read for the price `up` asks
        about, where the quote, the checks and the launch each made their own). A command that
        runs for hours (a followed run's recoveries, a bake) builds a new one now and then, and
        so reads credentials that a tool rewrote meanwhile."""
        key = spec.model_dump_json()  # as recorded: completing a 0.1 spec draws a new launch token
        now = time.monotonic()
        with self._providers_lock:
            kept = self._providers.get(key)
            if kept is None or now - kept[0] >= PROVIDER_KEPT_S:
                kept = self._providers[key] = (now, get_provider(self.home, self._complete(spec)
                                                                 if spec.version < 2 else spec))
            return kept[1]

    def _complete(self, spec: ClusterSpec) -> ClusterSpec:
        """A spec recorded by gpuctl 0.1 holds only what the user asked for; as 0.1 did, the rest
        (profile, login user, remote.*) comes from the settings of now, or their defaults."""
        try:
            now = self.settings().settings.model_copy(update={"provider": spec.provider, "cluster": spec.name})
            fresh = spec_from_settings(now)
        except ConfigError:
            return spec
        return ClusterSpec.model_validate({**fresh.model_dump(), **spec.model_dump(exclude_unset=True), "version": 2})

    # --- hosts: one connection per instance and command -------------------------------------

    def hosts(self, cluster: ClusterRecord, connect_timeout_s: float | None = None) -> list[tuple[InstanceRecord, Host]]:
        """Every instance of the cluster with a Host for it, connected once and reused."""
        every = self.ledger.instances(cluster.id)
        # An instance that ended (one a recovery replaced) is history, not a host.
        instances = sorted([i for i in every if i.state not in ENDED_STATES] or every, key=lambda i: i.node)
        if not instances:
            raise RemoteError(f"cluster {cluster.name!r} has no instance", f"Release it: `gpuctl down {cluster.name} -y`.")
        if cluster.id in self._unreachable:  # one wait per command for a host that does not answer
            raise self._unreachable[cluster.id]
        # A short wait asked for (a report's) never exceeds what the user set for this cluster.
        wait = connect_timeout_s or self.connect_timeout_s
        if wait is not None:
            wait = min(wait, cluster.spec.remote.connect_timeout_s)
        provider = None
        out = []
        for inst in instances:
            key = (cluster.id, inst.id)
            if key not in self._hosts:
                provider = provider or self.provider(cluster.spec)
                try:
                    self._hosts[key] = provider.host(inst, wait, self.on_wait)
                except GpuctlError as exc:
                    self._unreachable[cluster.id] = exc
                    self.unreachable_ids.add(inst.id)
                    raise
            out.append((inst, self._hosts[key]))
        return out

    def host(self, cluster: ClusterRecord) -> tuple[InstanceRecord, Host]:
        """The cluster's first instance (the one runs start on) and its Host."""
        return self.hosts(cluster)[0]

    def forget_hosts(self, cluster: ClusterRecord) -> None:
        """Drop this command's connections to the cluster and what it learnt of unreachable hosts
        (its instances were replaced)."""
        for host in [self._hosts.pop(k) for k in list(self._hosts) if k[0] == cluster.id]:
            self._facts.pop(host, None)
            host.close()
        self._unreachable.pop(cluster.id, None)

    def working(self, cluster: ClusterRecord, what: str) -> Heartbeat:
        """Context manager: tells the cluster's watchdogs that gpuctl is at work there (a push, a
        preflight, `exec`, `ssh`, `logs -f`), so none of it is taken for idleness."""
        return Heartbeat([host for _, host in self.hosts(cluster)], what)

    def close(self) -> None:
        """Close the connections this command opened."""
        for host in self._hosts.values():
            host.close()
        self._hosts.clear()
        self._facts.clear()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # --- what the user named ------------------------------------------------------------------

    def resolve_cluster(self, name: str | None) -> ClusterRecord:
        """The named live cluster, else the default, else the only one; errors say which to pick."""
        if name:
            found = self.ledger.live_cluster(name)
            if found is None:
                names = [c.name for c in self.ledger.clusters(include_down=False)]
                raise NotFoundError(f"no cluster named {name!r} is up",
                                    f"Clusters up: {', '.join(names)}." if names else "Start one with `gpuctl up`.")
            return found
        default = self.ledger.default_cluster()
        if default:
            return default
        # A bake's or a plan's own cluster is never "the only one": it is released under the run.
        live = [c for c in self.ledger.clusters(include_down=False) if not c.spec.launched_for]
        if len(live) == 1:
            return live[0]
        if not live:
            raise NoClusterError("no cluster is up")
        raise ConflictError(f"several clusters are up ({', '.join(c.name for c in live)}) and none is the default",
                            "Name one: `--cluster NAME` (`gpuctl down NAME` for down).")

    def find_run(self, run_id: str | None) -> RunRecord:
        """The named run (a unique prefix or suffix of its id will do), else the newest."""
        if run_id is not None:
            run = self.ledger.run(self.ledger.resolve_run_id(run_id))
            if run is None:
                raise NotFoundError(f"no run named {run_id!r}", "Run `gpuctl status` to list runs.")
            return run
        runs = self.ledger.runs()
        if not runs:
            raise NotFoundError("no run yet", "Start one with `gpuctl train PROJECT`.")
        return runs[-1]

    def live_cluster_of(self, run: RunRecord) -> ClusterRecord | None:
        """The cluster the run ran on, if it is still up (never a newer cluster of the same name)."""
        try:
            cluster = self.ledger.cluster(run.cluster_id)
        except KeyError:
            return None
        return cluster if cluster.state == "up" else None

    @contextmanager
    def cluster_lock(self, cluster: ClusterRecord, progress: Progress = quiet,
                     wait_s: float | None = None) -> Iterator[ClusterRecord]:
        """Serialize the commands that conflict on one cluster (`train` starting a job, `down`
        releasing it), across processes. Yields the cluster as the ledger has it once the lock is
        held: a `train` that waited for a `down` finds the cluster down and must not start.
        With `wait_s` (the brake: `down`, `stop`), a holder that keeps it longer (a `train`
        stopped with Ctrl-Z) is named and gone ahead without: it finds the cluster released."""
        import fcntl

        locks = self.home / "locks"
        try:
            locks.mkdir(mode=0o700, parents=True, exist_ok=True)
            # 0600 whatever the umask: every file under the home is the owner's alone.
            fd = os.open(locks / f"cluster-{cluster.id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # a full or read-only disk under the home
            if wait_s is None:
                raise ConfigError(f"cannot take cluster {cluster.name!r}'s lock in {locks}: {exc.strerror}",
                                  "Free space on that disk, or make the gpuctl home writable.") from None
            progress(f"cannot take cluster {cluster.name!r}'s lock ({exc.strerror}); going ahead without it")
            yield self.ledger.cluster(cluster.id)
            return
        os.fchmod(fd, 0o600)  # one an older gpuctl made 0644
        held = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                holder = _holder(fd)
                progress(f"waiting for another gpuctl command{holder} on cluster {cluster.name!r} to finish")
                held = _wait_lock(fd, wait_s)
                if not held:
                    progress(f"another gpuctl command{holder} still holds cluster {cluster.name!r} after "
                             f"{wait_s:.0f} s; going ahead without it (it will find the cluster released)")
            if held:
                _note_holder(fd)
            yield self.ledger.cluster(cluster.id)
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _down_mark(self, cluster: ClusterRecord) -> Path:
        return self.home / "locks" / f"cluster-{cluster.id}.down"

    @contextmanager
    def releasing(self, cluster: ClusterRecord) -> Iterator[None]:
        """`down` releases the cluster: a command that held it meanwhile (stopped, then resumed)
        must not start anything there. Marked in a file (the ledger says so too once the release
        is recorded; a full disk may keep it from that); a release that fails takes it back."""
        mark = self._down_mark(cluster)
        try:
            mark.touch(mode=0o600)
        except OSError:
            pass
        try:
            yield
        except BaseException:
            mark.unlink(missing_ok=True)
            raise

    def settle_release(self, cluster: ClusterRecord) -> None:
        """The ledger holds the cluster's release (or it is up again, resumed on a replacement):
        the mark has done its work; left, it would refuse a later `train --resume` there."""
        try:
            self._down_mark(cluster).unlink(missing_ok=True)
        except OSError:
            pass

    def released(self, cluster: ClusterRecord) -> bool:
        """Whether a `down` began on the cluster since this command found it up."""
        return self._down_mark(cluster).exists() or self.ledger.cluster(cluster.id).state != "up"

    def kept_run(self, run: RunRecord) -> tuple[Host, str] | None:
        """(a Host, the run's directory there) where its released cluster's provider keeps it."""
        try:
            spec = self.ledger.cluster(run.cluster_id).spec
        except KeyError:
            return None
        return self.provider(spec).kept_run(run.run_id)

    def run_on_live_cluster(self, run_id: str | None) -> tuple[RunRecord, ClusterRecord]:
        """The run and its cluster, which must still be up (for pull, attach)."""
        run = self.find_run(run_id)
        cluster = self.live_cluster_of(run)
        if cluster is None:
            raise NotFoundError(f"run {run.run_id} was on cluster {run.cluster!r}, which is down",
                                f"Its log and reports are kept: gpuctl logs {run.run_id}; gpuctl cost {run.run_id}")
        return run, cluster


def _wait_lock(fd: int, wait_s: float | None) -> bool:
    """Wait for the lock on fd: for ever (None), else up to wait_s seconds; whether it is held."""
    import fcntl

    if wait_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    try:
        poll(lambda: _try_lock(fd), wait_s, first_delay_s=0.05, max_delay_s=0.5)
    except TimedOut:
        return False
    return True


def _try_lock(fd: int) -> bool | None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    return True


def _note_holder(fd: int) -> None:
    """This process's pid in the lock file, for a command that waits to name (best effort: a
    full disk keeps the lock working, without the name)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """" (pid N[, stopped])" of the process the lock file names, if it still runs."""
    try:
        pid = int(os.pread(fd, 16, 0).decode().strip() or "0")
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read(512).rsplit(b")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return ""
    return f" (pid {pid}, stopped: `fg` or `kill -CONT {pid}` resumes it)" if state in (b"T", b"t") else f" (pid {pid})"


def open_session(flags: Mapping[str, Any] | None = None) -> Session:
    """A session over the user's gpuctl home ($GPUCTL_HOME or the platform's data dir)."""
    return Session(gpuctl_home(), flags)
