"""The use cases in gpuctl.ops, driven directly with a fake provider and host (tests/fakes.py):
identity per `up`, failed launches, reconcile, settings that break after `up`, run end times."""

from __future__ import annotations

import os
import shutil

import pytest

from gpuctl import provision
from gpuctl.cli.render import questions
from gpuctl.errors import CloudError, ConfigError
from gpuctl.model.records import RunRecord
from gpuctl.model.requests import UpRequest
from gpuctl.model.specs import ClusterSpec
from gpuctl.ops import clusters, costs, release, run_state
from gpuctl.ops.session import Session
from gpuctl.remote import jobs
from tests.fakes import FakeProvider, unscripted


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setitem(provision.PROVIDERS, "fake", "tests.fakes:FakeProvider")
    FakeProvider.reset()
    yield FakeProvider.world
    assert not unscripted(FakeProvider.world), "commands no test scripted (tests/fakes.py)"


def session(tmp_path, **env) -> Session:
    base = {"GPUCTL_PROVIDER": "fake", "HOME": str(tmp_path / "user")}
    return Session(tmp_path / "home", env={**base, **env})


def test_each_up_of_a_name_is_its_own_cluster_with_its_own_dollars(fake, tmp_path):
    s = session(tmp_path)
    first = clusters.up(s, UpRequest(usd_per_hour=36.0)).cluster
    (i1,) = s.ledger.instances(first.id)
    fake["ended"][i1.id] = i1.launched_at + 100  # ran 100 s at $36/h = $1
    release.down(s, "default")
    second = clusters.up(s, UpRequest(usd_per_hour=3600.0)).cluster
    (i2,) = s.ledger.instances(second.id)
    fake["ended"][i2.id] = i2.launched_at + 10  # 10 s at $3600/h = $10
    release.down(s, "default")
    report = costs.cost(s)
    assert [c.id for c in report.clusters] == [first.id, second.id]
    assert [round(c.usd, 6) for c in report.clusters] == [1.0, 10.0]
    assert report.total_usd == pytest.approx(11.0)


def test_the_question_and_its_launch_share_one_spec_and_the_next_up_of_the_session_makes_its_own(fake, tmp_path):
    s = session(tmp_path)
    assert clusters.launch_question(s, 36.0) is not None
    asked = s.launch_specs[36.0]
    first = clusters.up(s, UpRequest(usd_per_hour=36.0)).cluster
    assert first.spec.launch_token == asked.launch_token and s.launch_specs == {}
    release.down(s, "default")
    second = clusters.up(s, UpRequest(usd_per_hour=36.0)).cluster  # no question: a spec of its own
    assert second.spec.launch_token not in (first.spec.launch_token, "")


def test_a_provider_serves_its_spec_for_a_while_then_a_new_one_is_built(fake, tmp_path, monkeypatch):
    from gpuctl.ops import session as session_module

    now = [100.0]
    monkeypatch.setattr(session_module.time, "monotonic", lambda: now[0])
    s = session(tmp_path)
    spec = clusters.up(s).cluster.spec
    one = s.provider(spec)
    assert s.provider(spec) is one and s.provider(spec.model_copy(update={"launch_token": "other"})) is not one
    old = spec.model_copy(update={"version": 1})  # a 0.1 spec: completed from the settings, one provider still
    assert s.provider(old) is s.provider(old)
    now[0] += session_module.PROVIDER_KEPT_S  # a long command: credentials may have been rewritten
    assert s.provider(spec) is not one and len(s._providers) == 3


def test_a_failed_up_leaves_no_cluster_unless_something_exists(fake, tmp_path):
    s = session(tmp_path)
    fake["fail_launch"] = CloudError("no such instance type")
    with pytest.raises(CloudError):
        clusters.up(s)
    assert s.ledger.clusters() == []
    fake["leave_on_failure"] = True  # killed half-way: the cloud holds something of it
    with pytest.raises(CloudError):
        clusters.up(s)
    (kept,) = s.ledger.clusters()
    assert kept.state == "up"  # so `status` shows it and `down` releases it
    fake["fail_launch"] = None
    assert release.down(s, "default").released
    # A provider that cannot even be asked (no credentials, say) refuses before anything is recorded.
    fake["refuse"] = CloudError("no AWS credentials")
    with pytest.raises(CloudError):
        clusters.up(s)
    assert [c.state for c in s.ledger.clusters()] == ["down"]


def test_status_cost_and_down_work_from_the_recorded_spec_when_settings_break(fake, tmp_path):
    clusters.up(session(tmp_path))
    broken = session(tmp_path, GPUCTL_GUARDS__IDLE="5 parsecs", GPUCTL_PROVIDER="nowhere")
    with pytest.raises(ConfigError):
        broken.settings()
    assert costs.status(broken).clusters[0].state == "up"
    assert costs.cost(broken).clusters[0].usd >= 0
    assert release.down_target(broken, None) == "default"
    assert release.down(broken, None).cluster == "default"


def test_reconcile_closes_a_cluster_at_the_providers_end_time(fake, tmp_path):
    s = session(tmp_path)
    c = clusters.up(s).cluster
    (inst,) = s.ledger.instances(c.id)
    fake["ended"][inst.id] = inst.launched_at + 60
    status = costs.status(s)
    assert status.clusters[0].state == "down" and status.clusters[0].note == "fake end"
    assert s.ledger.cluster(c.id).terminated_at == inst.launched_at + 60
    assert status.clusters[0].usd == pytest.approx(60 * 36.0 / 3600)


def test_a_run_ends_when_its_job_ended_on_the_instance_not_when_gpuctl_looked(fake, tmp_path):
    s = session(tmp_path)
    c = clusters.up(s).cluster
    (inst,) = s.ledger.instances(c.id)
    host = FakeProvider(tmp_path, c.spec).host(inst)
    paths = jobs.JobPaths("/fake/runs/r1")
    run = RunRecord(run_id="r1", cluster=c.name, cluster_id=c.id, project="/p", entry="t.py", state="running",
                    started_at=1_000.0, usd_per_hour=36.0, run_dir=paths.run_dir)
    s.ledger.put_run(run)
    # The instance's clock is 7 hours off the client's: only the difference counts.
    host.files[paths.started] = b"26200.5\n"
    host.files[paths.ended] = b"26245.5\n"
    host.files[paths.exitcode] = b"0\n"
    done = run_state.refresh(s, run)
    assert done.state == "succeeded" and done.ended_at == pytest.approx(1_045.0)
    (shown,) = costs.status(s).runs
    assert shown.elapsed_s == pytest.approx(45.0) and shown.usd == pytest.approx(0.45)


def test_a_run_of_an_earlier_cluster_never_reads_the_new_cluster_of_that_name(fake, tmp_path):
    s = session(tmp_path)
    old = clusters.up(s).cluster
    s.ledger.put_run(RunRecord(run_id="r-old", cluster="default", cluster_id=old.id, project="/p", entry="t.py",
                               state="running", started_at=1.0, run_dir="/fake/runs/r-old"))
    release.down(s, "default")  # its host is gone; the run was stopped or lost there
    clusters.up(s)
    assert run_state.refresh(s, s.ledger.run("r-old")).state in ("stopped", "lost")


def test_launch_question_and_bad_prices(fake, tmp_path):
    s = session(tmp_path)
    asked = clusters.launch_question(s, 2.0)
    assert asked is not None and asked.quote.usd_per_hour == 2.0 and asked.instance_type is None
    assert questions.launch(asked).startswith("start fake cluster 'default' at $2.0000/h (the fake's price), billed")
    for bad in (-1.0, float("inf"), float("nan"), 1e9):
        with pytest.raises(ConfigError):
            clusters.up(s, UpRequest(usd_per_hour=bad))
    assert s.ledger.clusters() == []


def test_a_run_whose_machine_ended_unwatched_stops_costing_when_the_machine_ended(fake, tmp_path):
    s = session(tmp_path)
    c = clusters.up(s).cluster
    (inst,) = s.ledger.instances(c.id)
    s.ledger.put_run(RunRecord(run_id="r", cluster=c.name, cluster_id=c.id, project="/p", entry="t.py",
                               state="running", started_at=inst.launched_at - 3600, usd_per_hour=36.0,
                               run_dir="/fake/r"))
    fake["ended"][inst.id] = inst.launched_at - 3000  # a guard powered it off 10 minutes in, an hour ago
    (run,) = costs.status(s).runs
    assert run.state == "lost" and run.elapsed_s == pytest.approx(600) and run.usd == pytest.approx(6.0)


def test_a_cluster_recorded_by_gpuctl_0_1_is_completed_from_the_settings(fake, tmp_path):
    s = session(tmp_path, GPUCTL_REMOTE__PYTHON="/opt/tf/bin/python")
    legacy = ClusterSpec.model_validate({"name": "old", "provider": "fake", "usd_per_hour": 2.0, "version": 1})
    provider = s.provider(legacy)
    assert provider.spec.version == 2 and provider.spec.usd_per_hour == 2.0  # what it recorded stays
    assert provider.spec.name == "old" and provider.spec.launch_token  # the rest: today's settings


def test_a_cloud_that_cannot_be_asked_leaves_the_ledgers_view(fake, tmp_path):
    s = session(tmp_path)
    c = clusters.up(s).cluster
    fake["unreachable"] = CloudError("could not connect to the endpoint URL")
    assert costs.status(s).clusters[0].state == "up"
    assert s.ledger.cluster(c.id).state == "up"


def test_down_waits_for_a_starting_train_and_a_waiting_train_finds_the_cluster_down(fake, tmp_path):
    import threading

    s = session(tmp_path)
    c = clusters.up(s).cluster
    holder = session(tmp_path)
    done = threading.Event()
    with holder.cluster_lock(c):  # a train in the middle of starting its job
        t = threading.Thread(target=lambda: (release.down(session(tmp_path), "default"), done.set()))
        t.start()
        assert not done.wait(0.5)  # down waits for the start to finish
    t.join(10)
    assert done.is_set()
    with holder.cluster_lock(c) as now:
        assert now.state == "down"  # so a train that waited must not start


def test_down_after_run_is_timed_by_the_instances_clock(fake, tmp_path):
    from gpuctl.model.records import CommandResult
    from gpuctl.ops import guards

    s = session(tmp_path, GPUCTL_GUARDS__DOWN_AFTER_RUN="true")
    c = clusters.up(s).cluster
    inst, host = s.host(c)
    host.answers["date"] = CommandResult(argv=("date",), returncode=0, stdout="1234567.0\n", stderr="")
    cfg = guards._config(s.settings(), s.provider(c.spec), c, inst, host, {})
    assert cfg.down_after_run_since == 1234567.0 and cfg.cluster_key == guards.cluster_key(c)
    assert guards._config(s.settings(), s.provider(c.spec), c, inst, host, cfg.to_dict()).idle_s == cfg.idle_s
    # A config written by another cluster on the same host lends this one nothing, also one that
    # another gpuctl home numbered the same (every home counts its clusters from 1).
    foreign = {"cluster_key": f"{c.id}-someone-elses-token", "idle_s": 10, "on_fire": "stop-jobs"}
    cfg = guards._config(s.settings(), s.provider(c.spec), c, inst, host, foreign)
    assert cfg.idle_s == 1800 and cfg.on_fire == "poweroff"


def test_a_command_waiting_for_the_cluster_lock_says_so(fake, tmp_path):
    """`down` behind a `train` that is still starting (or the reverse) used to wait silently."""
    import threading
    import time

    s = session(tmp_path)
    c = clusters.up(s).cluster
    held, release = threading.Event(), threading.Event()

    def holder():
        with session(tmp_path).cluster_lock(c):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    said = []
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    with s.cluster_lock(c, said.append):
        pass
    t.join()
    assert said == [f"waiting for another gpuctl command (pid {os.getpid()}) on cluster {c.name!r} to finish"]
    assert time.monotonic() - t0 >= 0.2
    with s.cluster_lock(c, said.append):  # free: nothing said
        pass
    assert len(said) == 1


def test_the_cluster_lock_file_is_the_owners_alone(fake, tmp_path):
    """The lock file locks/cluster-N.lock was created 0644 (by the umask), every other file 0600."""
    import os
    import stat

    s = session(tmp_path)
    c = clusters.up(s).cluster
    old = os.umask(0o022)
    try:
        with s.cluster_lock(c):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(s.home / "locks" / f"cluster-{c.id}.lock").st_mode) == 0o600


def test_a_cluster_a_use_case_launched_for_itself_is_never_the_only_one_picked(fake, tmp_path):
    """A plan's probe cluster (or a bake's) was "the only one up" for a `train`, `stop` or `down`
    that named no cluster: the user's run landed there and the plan's release ended it."""
    from gpuctl.errors import NoClusterError

    s = session(tmp_path, GPUCTL_CLUSTER="plan-1a2b-g5-xlarge")
    probe = clusters.up(s, UpRequest(make_default=False, launched_for="plan")).cluster
    assert probe.spec.launched_for == "plan" and s.ledger.default_cluster() is None
    mine = session(tmp_path)
    with pytest.raises(NoClusterError):
        mine.resolve_cluster(None)
    assert mine.resolve_cluster("plan-1a2b-g5-xlarge").id == probe.id  # by its name, still
    own = clusters.up(session(tmp_path, GPUCTL_CLUSTER="lab"), UpRequest(make_default=False)).cluster
    assert mine.resolve_cluster(None).id == own.id  # the user's one, not the probe


def test_a_lock_that_cannot_be_made_holds_the_brake_back_but_not_train(fake, tmp_path):
    """A home whose locks cannot be written (here: `locks` is a file, as a broken or full home
    leaves it): `down` and `stop` go ahead and say so; a command that starts work refuses."""
    s = session(tmp_path)
    c = clusters.up(s).cluster
    shutil.rmtree(s.home / "locks", ignore_errors=True)
    (s.home / "locks").write_text("not a directory")
    said: list[str] = []
    with s.cluster_lock(c, said.append, wait_s=1.0) as record:
        assert record.state == "up"
    assert said and "going ahead without it" in said[0]
    with pytest.raises(ConfigError, match="cannot take cluster"):
        with s.cluster_lock(c):
            pass
    assert release.down(s, c.name, said.append).released


def _preempted(s: Session, cluster) -> None:
    """The cluster's instance ended under it (a spot interruption), as recovery finds it."""
    import time

    for inst in s.ledger.instances(cluster.id):
        FakeProvider.world["instances"].pop(inst.id, None)
        s.ledger.put_instance(cluster.id, inst.model_copy(update={"state": "terminated", "terminated_at": time.time()}))


def test_a_replacement_launched_while_down_went_ahead_is_ended_again(fake, tmp_path):
    """Recovery holds the cluster through a launch of minutes; `down` goes ahead after 5 s. What
    the launch made must not bill on under a cluster the ledger calls down."""
    from gpuctl.errors import ConflictError
    from gpuctl.ops import recovery

    s = session(tmp_path)
    c = clusters.up(s).cluster
    _preempted(s, c)
    FakeProvider.world["on_launch"] = lambda: release.down(session(tmp_path), c.name)
    with pytest.raises(ConflictError, match="ended again"):
        recovery.replace(s, s.ledger.cluster(c.id), lambda _: None, False)
    assert not FakeProvider.world["instances"], "the replacement kept billing"


def test_resume_after_down_brings_the_cluster_back_and_nothing_refuses_it(fake, tmp_path):
    """The mark `down` leaves while it releases goes once the ledger records the release: a later
    `train --resume` that reopens the cluster on a replacement (recovery.replace) may start there."""
    s = session(tmp_path)
    c = clusters.up(s).cluster
    release.down(s, c.name)
    assert s.released(c)  # down, in the ledger
    s.ledger.reopen_cluster(c.id)  # as recovery.replace does for `train --resume` after a down
    assert not s.released(c), "a resumed run would be refused on its own cluster"
