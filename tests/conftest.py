"""Shared fixtures: every test gets its own gpuctl home, user home and working directory, and the
tmux servers its clusters started are killed afterwards."""

from __future__ import annotations

import functools
import gc
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuctl.cli import cli as gpuctl_cli
from gpuctl.ops.guards import PAYLOAD_DIR
from tests import sshd
from tests.aws import aws, moto_server  # noqa: F401  (fixtures)
from tests.imds import imds, imds_server  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent
HOST_PYTHON = REPO / ".venv" / "bin" / "python"  # what the sshd test hosts run payloads and jobs with

# The two tiers (CONTRIBUTING.md). Each test is marked from the fixtures it uses, so a new test lands
# in its tier without anyone remembering to mark it; a file or a test may declare more
# (`pytestmark = pytest.mark.tf`). `--fast` (./scripts/test --fast) leaves out every test marked
# sshd, tf or slow.
TIER_FIXTURES = {
    # Real OpenSSH hosts in network namespaces (root). Every lab fixture is one of these or uses one.
    "sshd": {"ssh_lab", "node_lab", "jump_lab", "plan_hosts"},
    # Real TensorFlow: `wheels` builds a wheelhouse of it for the setup step.
    "tf": {"wheels"},
    # Long without either: `small_wheels` tests make venvs and run pip (~10 s each).
    "slow": {"small_wheels"},
    # Mounts (a tmpfs of a few MB: a full disk under the gpuctl home; a loop device), which need root.
    "root": {"small_disk", "loop_device"},
    "browser": {"browser"},
}
FULL_TIER_ONLY = ("sshd", "tf", "slow", "root", "browser")


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: leave out tests marked sshd, tf, slow or root (no root, no TensorFlow, no sshd)")


def pytest_configure(config):
    config.pluginmanager.register(_GroupsTook(), "gpuctl-groups-took")
    if config.getoption("--fast"):
        # No TensorFlow in this process: a test that imports it (or a test module that does at
        # import time, which --fast would pay for even when the test is left out) fails saying so.
        sys.meta_path.insert(0, _NoTensorFlow())


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(item.fixturenames)
        for marker, fixtures in TIER_FIXTURES.items():
            if used & fixtures and not item.get_closest_marker(marker):
                item.add_marker(marker)
        if item.get_closest_marker("tf"):
            # Under xdist each group of TensorFlow tests runs on one worker, one at a time: more TF
            # processes at once on two cores make all slower, and some tests wait on their epochs.
            item.add_marker(pytest.mark.xdist_group(_tf_group(item)))
    if config.getoption("--fast"):
        full = [any(i.get_closest_marker(m) for m in FULL_TIER_ONLY) for i in items]
        keep = [i for i, f in zip(items, full) if not f]
        dropped = [i for i, f in zip(items, full) if f]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


def pytest_collection_finish(session):
    # What the imports made (botocore's models, moto, pydantic's validators: ~300,000 objects per
    # worker) lives to the end: frozen, the collector stops walking it again on every full
    # collection (a fast-tier worker spent ~2 s in them).
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    # Python's last collection at exit walked every worker's whole heap, four at once on two cores:
    # 4-5 s between the last test and the summary, every run (the fast tier side by side:
    # 95.6 and 94.7 s without, 90.2 and 89.5 s with). Collected first, while pytest still hears
    # what finalizers raise (its own last collection, after this, finds nothing left to walk).
    gc.collect()
    gc.freeze()


class _GroupsTook:
    """Fails, saying why, each test that xdist's --dist loadgroup did not group: it groups by
    suffixing a test's id with "@group", which pytest 9.2's structured ids silently ignore
    (pytest-dev/pytest-xdist#1386); the TensorFlow tests then ran several at once, slower and
    flakier, and nothing said so. (Failing the collection instead makes xdist's controller die
    with an assertion that hides the message.)"""

    def __init__(self):
        self.lost: set[str] = set()

    @pytest.hookimpl(trylast=True)  # after xdist's own hook
    def pytest_collection_modifyitems(self, config, items):
        if getattr(config.option, "loadgroup", False):  # set on xdist's workers only
            self.lost = {i.nodeid for i in items
                         if i.get_closest_marker("xdist_group") and "@" not in i.nodeid.rsplit("]", 1)[-1]}

    def pytest_runtest_setup(self, item):
        if item.nodeid in self.lost:
            pytest.fail("--dist loadgroup did not group this test: this pytest and pytest-xdist do not work together "
                        "(pytest-dev/pytest-xdist#1386). Hint: pyproject.toml pins pytest; run scripts/bootstrap.",
                        pytrace=False)


# The TensorFlow tests run in two xdist groups of about equal length (~310 s each in ci14): the
# payload's own tests, the README demo and the single-host recoveries in one, the multi-node, ssh,
# aws and setup-step loops in the other: two TensorFlow tests at a time, not four, on two cores.
# GPUCTL_TEST_TF_GROUPS=1 puts them all in one group (one at a time; the suite's longest path then).
_PAYLOAD_SIDE = ("test_payload_tf.py", "test_readme.py", "test_faults.py", "test_plan.py", "test_spot_recovery.py",
                 "test_resume.py")


def _tf_group(item) -> str:
    if os.environ.get("GPUCTL_TEST_TF_GROUPS", "2") == "1":
        return "tf"
    return "tf-payload" if item.path.name in _PAYLOAD_SIDE else "tf-loops"


class _NoTensorFlow:
    """A meta path finder that refuses TensorFlow and Keras in the fast tier."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "keras", "tf_keras"):
            raise ImportError(f"{name} imported in the fast tier: mark the test tf (pytestmark = pytest.mark.tf) "
                              "or import it inside the test")
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture of the test (a module's lab included) is set up: a lab started for a test
    # not marked sshd (its fixture missing from TIER_FIXTURES) fails at once, naming the fix.
    sshd.MARKED = item.get_closest_marker("sshd") is not None
    global KEEPS_PREFLIGHT
    KEEPS_PREFLIGHT = not (item.get_closest_marker("tf") or item.get_closest_marker("preflight"))


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Point GPUCTL_HOME, HOME and the cwd at temp dirs; drop the caller's GPUCTL_* settings."""
    for var in list(os.environ):
        if var.startswith("GPUCTL_"):
            monkeypatch.delenv(var)
    home = tmp_path / "gpuctl-home"
    user = tmp_path / "user"
    work = tmp_path / "work"
    for d in (user, work):
        d.mkdir()
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    # Off a terminal gpuctl renders COLUMNS wide (else 200): xdist's workers inherit COLUMNS=80 from
    # it, and tables folded at 80 there but not in a plain run. A test that wants a width sets it.
    monkeypatch.delenv("COLUMNS", raising=False)
    # aws is the default provider; tests of the local loop say local here, aws tests override.
    monkeypatch.setenv("GPUCTL_PROVIDER", "local")
    monkeypatch.chdir(work)
    yield home
    from gpuctl.remote.jobs import end_processes
    from gpuctl.remote.local import LocalHost
    from gpuctl.remote.tmux import kill_server

    clusters = home / "clusters"
    if clusters.is_dir():
        # A multi-node local cluster's other nodes have tmux servers of their own.
        for root in (*clusters.glob("*/nodes/*"), *clusters.iterdir()):
            kill_server(LocalHost(root))
            # What outlived its server (a job that ignores SIGHUP, a watchdog): it would run on
            # through the rest of the session, holding memory and cores.
            end_processes(LocalHost(root), grace_s=1)


class Cli:
    """Runs gpuctl through Click's CliRunner and fails on any exit code the test did not expect."""

    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args: str, code: int = 0):
        result = self.runner.invoke(gpuctl_cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == code, (
            f"gpuctl {shlex.join(map(str, args))} exited {result.exit_code}, expected {code}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
        return result


@pytest.fixture
def gpuctl():
    return Cli()


@pytest.fixture
def browser():
    """Headless Chromium from Debian's packages, driven by Playwright (tests/web.py); one per test."""
    from tests.web import chromium

    with chromium() as b:
        yield b


@pytest.fixture
def make_project(tmp_path):
    """make_project(name, {"train.py": source, ...}) -> directory with those files."""

    def make(name: str = "proj", files: dict[str, str] | None = None) -> Path:
        root = tmp_path / "projects" / name
        root.mkdir(parents=True)
        for rel, text in (files or {}).items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return root

    return make


# A training script that needs no TensorFlow: it reports epochs through the payload's own writer
# (as a script that wants control may), so CLI tests run in a second instead of a minute.
QUICK_TRAIN = '''
import sys, time
import gpuctl_report

cfg = gpuctl_report.run_config()
writer = gpuctl_report.ReportWriter.shared(cfg["report_path"], cfg["run_id"], cfg["usd_per_hour"])
epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 2
print("args:", sys.argv[1:], flush=True)
for _ in range(epochs):
    start = time.time()
    time.sleep(0.2)
    writer.write(start, time.time(), 100, False, epochs, {"loss": 0.5})
print("done", flush=True)
'''


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(mb) -> a fresh tmpfs of that size (a disk that fills up), unmounted after the test."""
    mounted: list[Path] = []

    def make(mb: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0700", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def loop_device(tmp_path):
    """loop_device(mb, prepare=None) -> a real block device (a loop device over a sparse file;
    `prepare(path)` writes into the file first), detached (and unmounted) after the test."""
    made: list[str] = []

    def make(mb: int, prepare=None) -> str:
        image = tmp_path / f"disk{len(made)}.img"
        with open(image, "wb") as fh:
            fh.truncate(mb << 20)
        if prepare is not None:
            prepare(image)
        dev = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                             text=True).stdout.strip()
        made.append(dev)
        return dev

    yield make
    for dev in reversed(made):
        subprocess.run(["umount", "-l", dev], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", dev], check=False)


def fill(disk: Path) -> None:
    """Fill the disk to its last byte (what a runaway log or download does to a home)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (64 << 10, 4 << 10, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


@pytest.fixture
def quick_project(make_project):
    return make_project("quick", {"train.py": QUICK_TRAIN})



class SshLab:
    def __init__(self, key, hosts):
        self.key = key
        self.hosts = hosts


@pytest.fixture(scope="session")
def ssh_lab():
    """Two real sshd test hosts for the session (see tests/sshd.py)."""
    with sshd.running_lab("test-hosts", {1: "h1", 2: "h2"}) as (key, hosts):
        yield SshLab(key, hosts)


@pytest.fixture(scope="session")
def forwarding():
    """This machine forwards between the labs' hosts (sshd.peers), as a cluster's private network
    does, from the first test that needs it to the end of the session: set once, not per module,
    and shared with the other xdist workers (restored when the last one ends)."""
    with sshd.peers():
        yield


# Whether the test being set up starts its hosts with the preflight's answer kept (set per test
# below): every one not marked `tf` or `preflight`.
KEEPS_PREFLIGHT = True


@functools.cache
def kept_preflight() -> dict[str, str]:
    """{path on a test host: text}: the real preflight payload's kept answer for the Python every
    test host runs (this checkout's venv), where `train` looks for it in the hosts' work dir. Made
    here by the payload itself, with its own cache and flock in the venv: the first worker of a run
    imports TensorFlow, the others (and later runs, while the environment is the same) read it.
    Empty where TensorFlow does not import: the hosts then look for themselves and say why."""
    root = REPO / ".venv" / "gpuctl-tests"
    # An sshd session's environment, not the calling test's (a fake nvidia-smi on its PATH would
    # make an answer no host accepts).
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([str(HOST_PYTHON), str(PAYLOAD_DIR / "gpuctl_preflight.py"), "--cache", str(root)],
                         env=env, capture_output=True, text=True, timeout=600)
    lines = res.stdout.strip().splitlines()
    try:
        usable = res.returncode == 0 and bool(lines) and bool(json.loads(lines[-1]).get("tensorflow"))
    except ValueError:
        usable = False
    if not usable:
        return {}
    return {f"{sshd.WORKDIR}/_preflight/{f.name}": f.read_text() for f in (root / "_preflight").glob("*.json")}


def use_hosts(hosts, monkeypatch) -> None:
    """Fresh test hosts (empty /srv and /tmp) and settings that point gpuctl's remote side at them.
    Unless the test is about the preflight or TensorFlow, the hosts keep the preflight's answer for
    their Python, as a host that ran gpuctl before does: the first `train` of each test imported
    TensorFlow there (6 CPU-seconds) only to learn what every test before it had learnt."""
    sshd.fresh(hosts, kept_preflight() if KEEPS_PREFLIGHT else None)
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", sshd.WORKDIR)
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", str(HOST_PYTHON))
    monkeypatch.setenv("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "15")


@pytest.fixture
def ssh(ssh_lab, monkeypatch):
    """Fresh test hosts (empty /srv and /tmp) and settings that point gpuctl at them."""
    use_hosts(ssh_lab.hosts, monkeypatch)
    return ssh_lab


@pytest.fixture(scope="session")
def wheels():
    """A wheelhouse of this checkout's own TensorFlow (scripts/wheelhouse.py), built once, for the
    setup step on test hosts that have no network (`remote.wheelhouse`)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import wheelhouse

    return wheelhouse.build()


@pytest.fixture(scope="session")
def small_wheels(tmp_path_factory):
    """Small stand-ins for the wheels the setup step installs (tests/small_wheels.py): its install
    mechanics in seconds; `(small_wheels / "HOLD").touch()` holds an install mid-way."""
    from tests import small_wheels as build

    return build.build(tmp_path_factory.mktemp("small-wheels"))


MARK = "/srv/POWEROFF"  # what the test hosts' poweroff command leaves


@pytest.fixture
def fast_guards(ssh, monkeypatch):
    """The ssh lab with guards checked every second, idle after 3 s, and a poweroff that only
    leaves a mark in the host's own /srv."""
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "3s", "STALL": "0", "GRACE": "2s", "ON_FIRE": "poweroff",
                       "POWEROFF_COMMAND": f"date +%s.%N >> {MARK}"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    return ssh
