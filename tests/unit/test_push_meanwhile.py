"""`train` pushes the code while the preflight looks (ops/stages.py `push_and_check`, ops/setup.py
`looking`): on a new environment the preflight is seconds of TensorFlow import, or the wait for the
one `up` started, which the push no longer adds to. Driven with the fake provider, whose host here
answers the preflight's command itself. Bad cases tried: a preflight that fails (the cluster's
setup is marked failed, as before), a push that fails while the preflight still looks (its error is
raised only once the preflight is done with the connection), both failing (the preflight's failure
is still recorded), and Ctrl-C during the push (the connection is closed at once, which ends the
preflight's wait, instead of waiting for it)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from gpuctl import provision
from gpuctl.errors import RemoteError
from gpuctl.model.records import CommandResult
from gpuctl.ops import clusters, nodes, setup, stages
from gpuctl.ops.session import Session
from tests.fakes import UP_ANSWERS, FakeHost, FakeProvider, unscripted

REPORT = {"python": "3.11.7", "executable": "/usr/bin/python3", "nvidia_smi": [], "tensorflow": "2.21.0",
          "tf_gpus": [], "cuda": None, "cudnn": None, "error": None, "cached": False}


class LookingHost(FakeHost):
    """A host whose preflight and code push each wait (up to `patience` seconds) for the other to
    have begun, so that each says whether the other ran meanwhile; its push can fail."""

    def __init__(self, patience: float = 5.0):
        super().__init__()
        self.answers.update(UP_ANSWERS)  # the cluster's machine: `train` pushes the payload as `up` did
        self.pushing = threading.Event()
        self.looking = threading.Event()
        self.looked_during_push = self.pushed_during_look = None
        self.preflight_done = threading.Event()
        self.patience = patience
        self.push_error: BaseException | None = None
        self.preflight_says = json.dumps(REPORT) + "\n"
        self.hung_up = threading.Event()

    def run(self, argv, check=True, timeout=None, **kw):
        if any(str(a).endswith("/gpuctl_preflight.py") for a in argv):
            self.commands.append(tuple(argv))
            self.looking.set()
            self.looked_during_push = self.pushing.wait(self.patience)
            if self.hung_up.is_set():  # as SshHost says of a command whose connection was closed
                self.preflight_done.set()
                raise RemoteError("lost the connection to fake-host", "Check it.")
            self.preflight_done.set()
            return CommandResult(argv=tuple(argv), returncode=0, stdout=self.preflight_says, stderr="")
        return super().run(argv, check, timeout, **kw)

    def close(self):
        self.hung_up.set()
        self.pushing.set()  # a wait on the connection ends with it

    def push(self, src, dest, progress=None):
        if dest.startswith(self.root + "/code/"):
            self.pushing.set()
            self.pushed_during_look = self.looking.wait(self.patience)
            if self.push_error is not None:
                raise self.push_error
        return super().push(src, dest, progress)


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    monkeypatch.setitem(provision.PROVIDERS, "fake", "tests.fakes:FakeProvider")
    FakeProvider.reset()
    s = Session(tmp_path / "home", env={"GPUCTL_PROVIDER": "fake", "HOME": str(tmp_path / "user")})
    record = clusters.up(s).cluster
    (inst,) = s.ledger.instances(record.id)
    host = FakeProvider.world["hosts"][inst.id] = LookingHost()
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    # A new session, as a `train` command is: its host is the one above.
    yield Session(tmp_path / "home", env=s.env), record, host, project
    assert not unscripted(FakeProvider.world), "commands no test scripted (tests/fakes.py)"


def test_the_code_is_pushed_while_the_preflight_looks(cluster):
    s, record, host, project = cluster
    (node,) = stages.push_and_check(s, record, nodes.of(s, record), project, None, lambda line: None, check=True)
    # Each began before the other ended (in turn, the first would wait for the second in vain).
    assert host.looked_during_push is True and host.pushed_during_look is True
    assert node.env.report["tensorflow"] == "2.21.0" and node.code is not None


@pytest.mark.parametrize("push_fails", [False, True], ids=["push-ok", "push-fails-too"])
def test_a_failed_preflight_marks_the_setup_failed_even_beside_a_failed_push(cluster, push_fails):
    s, record, host, project = cluster
    host.preflight_says = "Traceback: python3 is broken\n"
    if push_fails:  # the push's error is the one raised; the preflight's is still recorded
        host.push_error = RemoteError("disk full on fake-host", "Free some space.")
    with pytest.raises(RemoteError, match="disk full" if push_fails else "preflight failed on fake-host"):
        stages.push_and_check(s, record, nodes.of(s, record), project, None, lambda line: None, check=True)
    assert setup.failed(s, record).startswith("preflight failed on fake-host")


def test_a_failed_push_waits_for_the_preflight_before_its_error(cluster):
    s, record, host, project = cluster
    host.push_error = RemoteError("disk full on fake-host", "Free some space.")
    host.patience = 0.0
    slow = host.run

    def run(argv, check=True, timeout=None, **kw):  # a preflight that takes a while after the push failed
        if any(str(a).endswith("/gpuctl_preflight.py") for a in argv):
            host.pushing.wait(5)
            time.sleep(0.3)
        return slow(argv, check, timeout, **kw)

    host.run = run
    with pytest.raises(RemoteError, match="disk full"):
        stages.push_and_check(s, record, nodes.of(s, record), project, None, lambda line: None, check=True)
    assert host.preflight_done.is_set()  # nothing uses the connection after prepare is left


def test_ctrl_c_during_the_push_closes_the_connection_instead_of_waiting_for_the_preflight(cluster):
    s, record, host, project = cluster
    host.push_error = KeyboardInterrupt()
    host.patience = 60.0  # a preflight that would take a minute
    pushed = host.push

    def push(src, dest, progress=None):  # the push waits for the preflight to start, then is interrupted
        if dest.startswith(host.root + "/code/"):
            host.looking.wait(5)
            raise KeyboardInterrupt
        return pushed(src, dest, progress)

    host.push = push
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        stages.push_and_check(s, record, nodes.of(s, record), project, None, lambda line: None, check=True)
    assert time.monotonic() - started < 5 and host.hung_up.is_set()
    assert host.preflight_done.wait(5)  # its wait ended with the connection
