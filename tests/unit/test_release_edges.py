"""The brake's bookkeeping, edge by edge (scripts/mutate found each unchecked): a search of the
cloud that fails still ends the instances the ledger knows, and closing a cluster in the ledger
keeps each instance's real end (billing stops there, not when gpuctl looked)."""

from __future__ import annotations

import time

import pytest

from gpuctl.errors import CloudError
from gpuctl.model.records import Resource
from gpuctl.ops import clusters, release
from tests.fakes import FakeProvider
from tests.unit.test_ops import fake, session  # noqa: F401  (fixture)


def _up_with_region(s):
    """A cluster of one live instance that says its region, and one that ended long ago."""
    c = clusters.up(s).cluster
    (inst,) = s.ledger.instances(c.id)
    s.ledger.put_instance(c.id, inst.model_copy(update={"region": "fake-east-1"}))
    s.ledger.put_instance(c.id, inst.model_copy(update={"id": "f-old", "state": "terminated",
                                                        "terminated_at": inst.launched_at - 50}))
    return c, inst.id


@pytest.mark.parametrize("failure, raised, said", [
    (CloudError("the cloud said no", "try later"), CloudError, "the cloud said no"),
    (RuntimeError("boom"), RuntimeError, "RuntimeError: boom"),  # no provider knows it: raised as it is
    (KeyError("k"), CloudError, "translated"),  # the provider's own library's error, as it says it
], ids=["gpuctl-error", "unknown", "foreign"])
def test_a_search_that_fails_still_ends_the_instances_the_ledger_knows(fake, tmp_path, monkeypatch,  # noqa: F811
                                                                     failure, raised, said):
    s = session(tmp_path)
    c, live_id = _up_with_region(s)
    s.unreachable_ids.add("f-gone")
    asked, released = [], []

    def discover(self, cluster=None, region=None):
        asked.append((cluster, region))
        raise failure

    def record(self, resources, progress, unreachable=frozenset()):
        released.append((list(resources), unreachable))
        progress("fake: released")  # the caller's progress, to say what it does

    monkeypatch.setattr(FakeProvider, "discover", discover)
    monkeypatch.setattr(FakeProvider, "release", record)
    monkeypatch.setattr(FakeProvider, "foreign_error", staticmethod(
        lambda exc: CloudError("translated", "h") if isinstance(exc, KeyError) else None), raising=False)
    lines: list[str] = []
    with pytest.raises(raised):
        release.release_everything(s, c, lines.append)
    assert asked == [(c.name, "fake-east-1")]
    assert released == [([Resource(provider="fake", kind="instance", id=live_id, region="fake-east-1",
                                   cluster=c.name)], frozenset({"f-gone"}))]
    assert lines == [f"{c.name}: could not look up all it holds ({said}); ending its 1 instance(s) the ledger knows",
                     "fake: released"]


def test_a_search_that_answers_releases_what_it_found(fake, tmp_path, monkeypatch):  # noqa: F811
    s = session(tmp_path)
    c, live_id = _up_with_region(s)
    s.unreachable_ids.add("f-gone")
    released, lines = [], []

    def record(self, resources, progress, unreachable=frozenset()):
        released.append((resources, unreachable))
        progress("fake: released")

    monkeypatch.setattr(FakeProvider, "release", record)
    found = release.release_everything(s, c, lines.append)
    assert [r.id for r in found] == [live_id] and released == [(found, frozenset({"f-gone"}))]
    assert lines == ["fake: released"]


def test_closing_a_cluster_keeps_each_instances_known_end(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    c, live_id = _up_with_region(s)
    ended = {i.id: i.terminated_at for i in s.ledger.instances(c.id)}["f-old"]
    before = time.time()
    release.close_in_ledger(s, c, "released 1 resource(s)")
    after = {i.id: i for i in s.ledger.instances(c.id)}
    assert after["f-old"].terminated_at == ended  # EC2's end stays: billing closes when it really ended
    assert after[live_id].state == "terminated" and before <= after[live_id].terminated_at <= time.time()
    closed = s.ledger.cluster(c.id)
    assert closed.state == "down" and closed.terminated_at == after[live_id].terminated_at  # the last end
    assert [(e[1], e[3], e[4]) for e in s.ledger.events(c.id)][-1] == (c.name, "down", "released 1 resource(s)")


def test_a_cluster_whose_instances_all_ended_closes_at_the_last_end_not_now(fake, tmp_path):  # noqa: F811
    s = session(tmp_path)
    c = clusters.up(s).cluster
    (inst,) = s.ledger.instances(c.id)
    # Terminated in the ledger but its end not known: it ends now; the one EC2 ended keeps its time.
    s.ledger.put_instance(c.id, inst.model_copy(update={"state": "terminated", "terminated_at": 1000.0}))
    release.close_in_ledger(s, c, "gone")
    assert s.ledger.cluster(c.id).terminated_at == 1000.0
    s = session(tmp_path, GPUCTL_CLUSTER="other")
    c2 = clusters.up(s).cluster
    (i2,) = s.ledger.instances(c2.id)
    s.ledger.put_instance(c2.id, i2.model_copy(update={"state": "terminated", "terminated_at": None}))
    release.close_in_ledger(s, c2, "gone")
    (closed,) = s.ledger.instances(c2.id)
    assert closed.terminated_at is not None and closed.terminated_at >= i2.launched_at
