"""One `train` on two nodes asks each question once: the payload pushed (its hash checked), the
GPUs counted, the guard config read on each node; the cluster's nodes and the budget rule once
for the whole command. Real parts: the local provider's two nodes (two work dirs on this machine,
each its own tmux server), a real LocalHost under a wrapper that counts what crosses to it."""

from __future__ import annotations

import collections
import json
import posixpath

import pytest

from gpuctl.ops import nodes
from gpuctl.provision.local import LocalProvider
from gpuctl.remote.local import LocalHost
from tests.conftest import QUICK_TRAIN

Asked = collections.Counter[tuple[str, str]]


class Counting(LocalHost):
    """This machine as one node, each question it is asked counted in `asked` by (its root, what)."""

    asked: Asked

    def _count(self, what: str) -> None:
        self.asked[(self.root, what)] += 1

    def run(self, argv, check=True, timeout=None, **kw):  # type: ignore[no-untyped-def]
        words = " ".join(argv)
        if "sha1sum" in words:
            self._count("payload hash")
        elif argv[:2] == ["nvidia-smi", "-L"]:
            self._count("gpus")
        return super().run(argv, check, timeout, **kw)

    def push(self, src, dest, progress=None):  # type: ignore[no-untyped-def]
        if posixpath.basename(dest) == "payload":
            self._count("payload push")
        return super().push(src, dest, progress)

    def read_bytes(self, path, offset=0, limit=1 << 20):  # type: ignore[no-untyped-def]
        if path.endswith("/guard/config.json"):
            self._count("guard config")
        return super().read_bytes(path, offset, limit)


@pytest.fixture
def counted(monkeypatch):
    asked: Asked = collections.Counter()
    real = LocalProvider.host

    def host(self, instance, connect_timeout_s=None, progress=None):  # type: ignore[no-untyped-def]
        made = real(self, instance, connect_timeout_s, progress)
        counting = Counting(made.root, made.command_timeout_s)
        counting.asked = asked
        return counting

    monkeypatch.setattr(LocalProvider, "host", host)
    for name in ("of", "refuse_budget"):
        real_fn = getattr(nodes, name)

        def spy(*args, _real=real_fn, _name=name, **kw):  # type: ignore[no-untyped-def]
            asked[("command", _name)] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(nodes, name, spy)
    return asked


def test_one_train_on_two_nodes_asks_each_question_once(gpuctl, make_project, counted, monkeypatch):
    monkeypatch.setenv("GPUCTL_TRAIN__KERAS", "3")  # no tf_keras here: the warning, not the refusal
    gpuctl("up", "--nodes", "2", "-y")
    counted.clear()  # `up`'s own questions are another command's
    project = make_project("proj", {"train.py": QUICK_TRAIN})
    run = json.loads(gpuctl("train", str(project), "--json").stdout)["run"]
    roots = {root for root, _ in counted if root != "command"}
    assert len(roots) == 2, counted
    for root in roots:
        for what in ("payload hash", "gpus", "guard config"):
            assert counted[(root, what)] == 1, (root, what, counted)
        assert counted[(root, "payload push")] <= 1, counted
    assert counted[("command", "of")] == 1 and counted[("command", "refuse_budget")] == 1, counted
    gpuctl("stop", run["run_id"])
