"""A node of a multi-node run whose machine is taken away (fake provider and hosts, tests/fakes.py):
the provider is asked about every node's machine, not only the chief's; a node gone ends the run
(lost, then preempted when the provider says it took the machine), naming the node; and the
run's segments remember every node's instance."""

from __future__ import annotations

import re
import time

import pytest

from gpuctl import provision
from gpuctl.model.records import CommandResult, RunRecord
from gpuctl.ops import clusters, costs, nodes, recovery, run_state, runs, stages, stop
from gpuctl.ops.session import Session
from tests.fakes import FakeHost, FakeProvider, Unscripted, unscripted


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(provision.PROVIDERS, "fake", "tests.fakes:FakeProvider")
    FakeProvider.reset()
    yield FakeProvider.world
    assert not unscripted(FakeProvider.world), "commands no test scripted (tests/fakes.py)"


def two_nodes(tmp_path):
    s = Session(tmp_path / "home", env={"GPUCTL_PROVIDER": "fake", "HOME": str(tmp_path / "user")})
    c = clusters.up(s).cluster
    (chief,) = s.ledger.instances(c.id)
    worker = chief.model_copy(update={"id": "f-worker", "node": 1})
    s.ledger.put_instance(c.id, worker)
    run = RunRecord(run_id="r", cluster=c.name, cluster_id=c.id, project="/p", entry="t.py", state="running",
                    started_at=time.time() - 60, usd_per_hour=72.0, run_dir="/fake/runs/r", nodes=2,
                    segments=(stages.segment_on([chief, worker], time.time() - 60, 72.0),))
    s.ledger.put_run(run)
    return s, c, chief, worker


def test_a_segment_remembers_every_nodes_instance(fake, tmp_path):
    s, _, chief, worker = two_nodes(tmp_path)
    (seg,) = s.ledger.run("r").segments
    assert (seg.instance_id, seg.node_ids, seg.usd_per_hour) == (chief.id, (worker.id,), 72.0)


def test_a_worker_taken_away_is_found_and_the_run_preempted_on_that_node(fake, tmp_path):
    s, _, chief, worker = two_nodes(tmp_path)
    run = s.ledger.run("r")
    assert recovery.taken_away(s, run) is None
    fake["ended"][worker.id] = time.time() - 5
    fake["interrupted"].add(worker.id)
    gone = recovery.taken_away(s, run)  # the chief's machine is fine: only the worker's tells
    assert gone is not None and gone.id == worker.id
    ended = recovery.mark_preempted(s, run, gone)
    assert (ended.state, ended.failed_node, ended.segments[-1].end) == ("preempted", 1, "preempted")


def test_a_worker_whose_machine_ended_ends_the_run_lost_however_the_chief_looks(fake, tmp_path):
    s, c, chief, worker = two_nodes(tmp_path)
    host = tmux_says(fake, chief, 0, "4242|0|||\n")  # the chief's pane lives: it trains, and would wait
    fake["ended"][worker.id] = time.time() - 5  # a guard's poweroff, say: not the provider's taking
    # status asks the chief whether the run has a checkpoint to resume from: none
    host.answers["find"] = CommandResult(argv=("find",), returncode=0, stdout="", stderr="")
    (shown,) = costs.status(s).runs  # status asks the provider, the ledger learns the worker ended
    assert (shown.state, shown.failed_node) == ("lost", 1)
    run = s.ledger.run("r")
    assert run.ended_at == pytest.approx(fake["ended"][worker.id])
    assert run.node_states == ("running", "lost")  # the chief still waits: a look stops nothing
    assert any("run-lost" in e[3] and "node 1" in e[4] for e in s.ledger.events(c.id))
    (waiting,) = [e[4] for e in s.ledger.events(c.id) if e[3] == "run-waiting"]
    assert "node 1 ended it; node(s) 0 still run it" in waiting and "gpuctl stop r" in waiting
    assert not [cmd for cmd in host.commands if cmd[0] == "kill"]
    # A command that acts stops the chief (its peer is gone: it would wait, billed): its pane's
    # process group had the SIGTERM (any tmux command would not do: every look runs one).
    settled = run_state.settle(s, run)
    assert ("kill", "-TERM", "--", "-4242") in [tuple(cmd) for cmd in host.commands]
    assert (settled.state, settled.node_states) == ("lost", ("stopped", "lost"))
    assert nodes.gone(s, c, run).id == worker.id


def test_a_lost_run_becomes_preempted_once_the_provider_says_it_took_the_machine(fake, tmp_path):
    s, c, _, worker = two_nodes(tmp_path)
    fake["ended"][worker.id] = time.time() - 5
    fake["interrupted"].add(worker.id)
    clusters.reconcile_live(s)
    lost = run_state.refresh(s, s.ledger.run("r"))
    assert (lost.state, lost.segments[-1].end) == ("lost", "lost")
    inst = recovery.taken_away(s, lost)
    preempted = recovery.mark_preempted(s, lost, inst)
    # What counts recoveries (and status, cost) reads the segment's end.
    assert (preempted.state, preempted.segments[-1].end) == ("preempted", "preempted")
    assert preempted.segments[-1].ended_at is not None


def test_only_the_machines_of_nodes_that_heard_the_notice_wait_for_ec2(fake, tmp_path):
    s, _, chief, worker = two_nodes(tmp_path)
    run = s.ledger.run("r")
    assert recovery.machines_taken(run.model_copy(update={"nodes": 1})) is None  # one node: its machine
    preempted = run.model_copy(update={"state": "preempted", "node_states": ("failed", "preempted"), "failed_node": 1})
    assert recovery.machines_taken(preempted) == {worker.id}
    both = preempted.model_copy(update={"node_states": ("preempted", "preempted")})
    assert recovery.machines_taken(both) == {chief.id, worker.id}


def test_a_cluster_missing_a_node_runs_nothing(fake, tmp_path):
    from gpuctl.errors import RemoteError

    s, c, _, worker = two_nodes(tmp_path)
    third = worker.model_copy(update={"id": "f-third", "node": 2})
    s.ledger.put_instance(c.id, third)
    fake["ended"][worker.id] = time.time()
    clusters.reconcile_live(s)
    with pytest.raises(RemoteError, match="lacks node 1"):
        stages.group_of(s, c)
    assert [n.rank for n in nodes.of(s, c)] == [0, 2]  # not renumbered: node 2 is still node 2


def test_a_follower_whose_ssh_failed_finds_a_node_gone_otherwise_and_ends_the_run(fake, tmp_path):
    from gpuctl.errors import RemoteError

    s, c, _, worker = two_nodes(tmp_path)
    run = s.ledger.run("r")
    with pytest.raises(RemoteError):  # SSH failed, nothing ended: the error stands
        recovery._node_gone(s, run, RemoteError("no answer"))
    fake["ended"][worker.id] = time.time() - 5  # powered off by its guard: not taken by the provider
    assert recovery.taken_away(s, run) is None  # (the ledger learns it ended)
    assert recovery._node_gone(s, run, RemoteError("no answer")).state == "lost"


def test_machines_taken_by_node_state_and_for_segments_recorded_before_node_ids(fake, tmp_path):
    s, _, chief, worker = two_nodes(tmp_path)
    run = s.ledger.run("r")
    leaving = run.model_copy(update={"node_states": ("leaving", "preempted"), "failed_node": 1})
    assert recovery.machines_taken(leaving) == {chief.id, worker.id}
    old = run.model_copy(update={"segments": (run.segments[0].model_copy(update={"node_ids": ()}),)})
    assert recovery.machines_taken(old) is None  # unknown: every young spot machine waits, as before


def tmux_says(fake, inst, rc: int, stdout: str, stderr: str = "") -> FakeHost:
    """What every tmux command on the instance's host answers."""
    from gpuctl.model.records import CommandResult

    host = fake["hosts"].setdefault(inst.id, FakeHost())
    host.answers["tmux"] = CommandResult(argv=("tmux",), returncode=rc, stdout=stdout, stderr=stderr)
    host.script("kill")  # a signal to a pane's process group: delivered

    def signalled(argv: tuple[str, ...]) -> None:  # its job exits as a stopped one does: no grace waited out
        if argv[0] == "kill":
            host.files["/fake/runs/r/exitcode"] = b"143\n"

    host.on_run = signalled
    return host


@pytest.mark.parametrize("rc, stderr", [(-1, ""),  # a client killed, or a channel closed without an exit status
                                        (1, "server exited unexpectedly"), (1, "lost server"),
                                        (127, "sh: 1: tmux: not found"),
                                        (0, "")])  # a session tmux has lists its pane: no line is no answer
def test_a_node_whose_tmux_gives_no_answer_is_not_lost_and_its_peers_train_on(fake, tmp_path, rc, stderr):
    """One look at a worker whose tmux did not answer called its run lost and stopped the chief
    (SIGTERM mid-epoch) while both still trained: the CI run of 2026-12-03 lost a two-node run so.
    Only tmux's "no such session" is a lost job; anything else is the next look's to decide."""
    s, c, chief, worker = two_nodes(tmp_path)
    tmux_says(fake, chief, 0, "4242|0|||\n")  # a live pane: the chief trains
    tmux_says(fake, worker, rc, "", stderr)
    run = run_state.settle(s, s.ledger.run("r"))  # even the look that acts
    assert (run.state, run.failed_node) == ("running", None)
    assert not [cmd for cmd in fake["hosts"][chief.id].commands if cmd[0] == "kill"]  # the chief trains on
    # The worker's exit code, once there, decides whatever tmux says.
    fake["hosts"][worker.id].files[f"{run.run_dir}/exitcode"] = b"1\n"
    run = run_state.refresh(s, s.ledger.run("r"))
    assert (run.state, run.failed_node, run.exit_code) == ("failed", 1, 1)


@pytest.mark.parametrize("stderr", ["can't find session: r", "no server running on /tmp/tmux-0/fake",
                                    "error connecting to /tmp/tmux-0/fake (No such file or directory)"])
def test_a_node_whose_tmux_says_the_session_is_gone_is_lost_and_its_peers_are_stopped(fake, tmp_path, stderr):
    s, c, chief, worker = two_nodes(tmp_path)
    tmux_says(fake, chief, 0, "4242|0|||\n")
    tmux_says(fake, worker, 1, "", stderr)
    run = run_state.refresh(s, s.ledger.run("r"))
    assert (run.state, run.failed_node, run.exit_code) == ("lost", 1, None)
    assert not [cmd for cmd in fake["hosts"][chief.id].commands if cmd[0] == "kill"]  # a look stops nothing
    run_state.settle(s, run)
    assert ("kill", "-TERM", "--", "-4242") in fake["hosts"][chief.id].commands  # it would wait for its peer, billed


def test_a_job_whose_tmux_never_answers_is_not_called_stopped_and_down_names_it(fake, tmp_path, monkeypatch):
    """Without the pane nothing can be signalled: `gpuctl stop` says so (the run stays live, not
    "stopped" while it trains on), and `down` releases anyway, naming it unconfirmed."""
    from gpuctl.errors import Unconfirmed
    from gpuctl.remote import jobs

    monkeypatch.setattr(jobs, "LOOK_PAUSE_S", 0.0)
    s, c, chief, worker = two_nodes(tmp_path)
    for inst in (chief, worker):
        tmux_says(fake, inst, 1, "", "server exited unexpectedly")
    with pytest.raises(Unconfirmed, match=r"could not stop r on fake-host: tmux list-panes exited 1: server exited"):
        stop.stop_run(s, c, s.ledger.run("r"))
    assert s.ledger.run("r").state == "running"
    assert len([cmd for cmd in fake["hosts"][chief.id].commands if "list-panes" in cmd]) == jobs.STOP_LOOKS
    stopped, left, why = stop.stop_runs(s, c)
    assert (stopped, left) == ([], ["r"]) and "server exited unexpectedly" in why


def test_a_run_lost_on_one_node_is_recorded_where_a_peers_tmux_cannot_be_asked_to_stop(fake, tmp_path, monkeypatch):
    from gpuctl.remote import jobs

    monkeypatch.setattr(jobs, "LOOK_PAUSE_S", 0.0)
    s, c, chief, worker = two_nodes(tmp_path)
    tmux_says(fake, chief, 1, "", "server exited unexpectedly")
    tmux_says(fake, worker, 1, "", "can't find session: r")
    run = run_state.settle(s, s.ledger.run("r"))  # the chief's stop was tried: it could not be confirmed
    assert (run.state, run.failed_node) == ("lost", 1)
    assert run.node_states == ("running", "lost")  # not "stopped": nothing reached it
    assert any(e[3] == "run-unconfirmed" and "node(s) 0 not confirmed stopped" in e[4] for e in s.ledger.events(c.id))


def test_exec_keeps_every_hosts_output_when_one_hosts_connection_goes(fake, tmp_path):
    """`gpuctl exec -- sudo reboot`: one host's connection ends under the command; the others'
    output is kept, and that host says why with ssh's own 255."""
    from gpuctl.errors import RemoteError
    from gpuctl.model.records import CommandResult

    s, c, chief, worker = two_nodes(tmp_path)
    host = fake["hosts"].setdefault(chief.id, FakeHost())
    host.answers["uptime"] = CommandResult(argv=("uptime",), returncode=0, stdout="up 3 days\n", stderr="")

    def busy(argv: tuple[str, ...]) -> CommandResult:  # exec marks the host busy while it runs, then not
        if not re.fullmatch(r"(mkdir -p /fake/guard/busy && : > |rm -f )/fake/guard/busy/exec-[0-9a-f]+", argv[-1]):
            raise Unscripted(f"unscripted shell line {argv}")
        return CommandResult(argv=argv, returncode=0, stdout="", stderr="")

    host.answers["sh"] = busy

    def gone(argv):
        raise RemoteError("lost the connection to fake-host (EOFError: the connection closed)")

    fake["hosts"].setdefault(worker.id, FakeHost()).on_run = gone
    first, second = runs.exec_command(s, ("uptime", "-p"))
    assert (first.returncode, first.stdout) == (0, "up 3 days\n")
    assert (second.returncode, second.stdout) == (255, "") and "lost the connection" in second.stderr
