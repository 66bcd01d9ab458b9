"""The watchdog's decisions as a pure function (payloads/gpuctl_decide.py): every
guard's edges in milliseconds. The real wiring (tmux, utmp, nvidia-smi, poweroff) is tested on
sshd hosts in integration/test_guards*.py."""

from __future__ import annotations

import ast
import sys

import pytest

from gpuctl.ops.guards import PAYLOAD_DIR
from gpuctl.payloads.gpuctl_protocol import WATCHDOG_FILES

sys.path.insert(0, str(PAYLOAD_DIR))  # the payloads import each other by bare name, as on the instance
import gpuctl_decide as d  # noqa: E402
from tests.waits import wait_for

T0 = 1_000_000.0  # the cluster's start, by the instance's clock
NO_LOGINS = ("/run/utmp", [], [])


def seen(runs=(), gpu=None, logins=NO_LOGINS, heartbeats=None, fired=None, notice=False, neighbours=None):
    return d.Observation(list(runs), gpu, logins, heartbeats or {}, fired, notice, neighbours or {})


def job(name="r1", running=True, ended_at=None, queued=False, log_mtime=None, peers=False):
    return d.Run(name, running, ended_at, queued, log_mtime, peers)


def cfg(**kw):
    base = {"started_at": T0, "usd_per_hour": 3.6, "on_fire": "poweroff", "grace_s": 60}
    base.update(kw)
    return base


def login(last_input):
    return {"user": "u", "line": "pts/0", "host": "h", "last_input": last_input, "quiet_s": 0}


# --- budget -------------------------------------------------------------------------------------

def test_budget_fires_at_the_limit_not_a_moment_before():
    c = cfg(budget_usd=1.0)  # $3.6/h: $1 after 1000 s
    assert d.decide(c, seen(), T0 + 999.999).reason is None
    at = d.decide(c, seen(), T0 + 1000.0)
    assert at.reason == "budget" and at.detail == "$1.0000 spent of a $1.0000 budget"
    assert at.state["fires_at"]["budget"] == pytest.approx(T0 + 1000.0)
    assert at.action == "poweroff"


@pytest.mark.parametrize("c", [cfg(budget_usd=0), cfg(budget_usd=-1), cfg(budget_usd=5, usd_per_hour=0),
                               cfg(budget_usd="five")], ids=["none", "negative", "free", "garbage"])
def test_no_budget_or_no_rate_never_fires(c):
    out = d.decide(c, seen(), T0 + 10 ** 7)
    assert out.reason is None and "budget" not in out.state["fires_at"]


def test_a_start_ahead_of_the_instances_clock_costs_nothing_yet():
    out = d.decide(cfg(budget_usd=0.01), seen(), T0 - 3600)  # clock skew: started_at in the future
    assert out.reason is None and out.state["spent_usd"] == 0.0


# --- hard cap -------------------------------------------------------------------------------------

def test_hard_cap_fires_at_its_time():
    c = cfg(hard_cap_at=T0 + 3600)
    assert d.decide(c, seen(), T0 + 3599.999).reason is None
    assert d.decide(c, seen(runs=[job()], gpu=90), T0 + 3600).reason == "hard-cap"  # even mid-run
    assert d.decide(cfg(hard_cap_at=0), seen(), T0 + 10 ** 9).state["fires_at"] == {}


def test_the_first_guard_in_order_is_the_reason():
    c = cfg(budget_usd=1.0, hard_cap_at=T0 + 10)
    assert d.decide(c, seen(), T0 + 1000).reason == "budget"


# --- run-done ------------------------------------------------------------------------------------------

def test_run_done_fires_a_grace_after_the_run_that_ended_after_it_was_armed():
    c = cfg(down_after_run=True, down_after_run_since=T0 + 100)
    ended = seen(runs=[job(running=False, ended_at=T0 + 100)])  # ended the moment it was armed: counts
    assert d.decide(c, ended, T0 + 159.9).reason is None
    out = d.decide(c, ended, T0 + 160)
    assert out.reason == "run-done" and out.state["fires_at"]["run-done"] == T0 + 160


def test_run_done_ignores_older_runs_runs_going_on_and_runs_it_fired_for():
    c = cfg(down_after_run=True, down_after_run_since=T0 + 100)
    older = job("old", running=False, ended_at=T0 + 99)
    assert d.decide(c, seen(runs=[older]), T0 + 10 ** 5).reason is None
    done = job("new", running=False, ended_at=T0 + 200)
    assert d.decide(c, seen(runs=[done, job("other")], gpu=90), T0 + 10 ** 5).reason is None  # another runs
    fired = {"reason": "run-done", "at": T0 + 300}
    assert d.decide(c, seen(runs=[done], fired=fired), T0 + 10 ** 5).reason is None
    later = job("later", running=False, ended_at=T0 + 400)  # a run after that firing: fires again
    assert d.decide(c, seen(runs=[done, later], fired=fired), T0 + 460).reason == "run-done"
    assert d.decide(cfg(down_after_run=False, down_after_run_since=T0), seen(runs=[done]), T0 + 10 ** 5).reason is None
    assert d.decide(cfg(down_after_run=True), seen(runs=[done]), T0 + 10 ** 5).reason is None  # never armed


# --- stall -------------------------------------------------------------------------------------------

def test_stall_warns_once_at_its_limit_and_fires_only_when_asked():
    c = cfg(stall_s=300)
    quiet = seen(runs=[job(log_mtime=T0)], gpu=0)
    assert d.decide(c, quiet, T0 + 299.9).state["stalled"] == []
    first = d.decide(c, quiet, T0 + 300)
    assert first.reason is None and first.state["stalled"] == ["r1"]
    assert first.notes == ["WARN stall: r1: GPU idle and log silent for 300s"]
    again = d.decide(c, quiet, T0 + 400, first.memory)
    assert again.notes == [] and again.state["stalled"] == ["r1"]  # warned once
    fire = d.decide(cfg(stall_s=300, on_stall="fire"), quiet, T0 + 300)
    assert fire.reason == "stall" and fire.detail == "r1 hung: GPU idle, log silent 300s"


def test_a_stalled_node_of_several_fires_whatever_on_stall_says():
    """Its peer ended (or hung): it waits on the collective, billed, and nobody's look stops it."""
    quiet = seen(runs=[job(log_mtime=T0, peers=True)], gpu=0)
    out = d.decide(cfg(stall_s=300), quiet, T0 + 300)
    assert out.reason == "stall" and out.detail == "r1 hung: GPU idle, log silent 300s (a node of several: it waits for a peer)"
    assert d.decide(cfg(stall_s=300), quiet, T0 + 299.9).reason is None
    assert d.decide(cfg(stall_s=0), quiet, T0 + 10_000).reason is None  # stall off: the user's call
    busy = seen(runs=[job(log_mtime=T0, peers=True)], gpu=90)
    assert d.decide(cfg(stall_s=300), busy, T0 + 1000).reason is None  # training: no stall


@pytest.mark.parametrize("case", [
    {"gpu": 50},  # the GPU works: not hung
    {"queued": True},  # waiting its turn: not started
    {"log_mtime": None},  # no log yet: counted as just written
    {"log_mtime": T0 + 10 ** 5},  # a log from the future (the clock was set back): not silent
], ids=["gpu-busy", "queued", "no-log", "future-log"])
def test_no_stall(case):
    run = job(queued=case.get("queued", False), log_mtime=case.get("log_mtime", T0))
    out = d.decide(cfg(stall_s=300, on_stall="fire"), seen(runs=[run], gpu=case.get("gpu", 0)), T0 + 1000)
    assert out.reason is None and out.state["stalled"] == []


# --- idle ------------------------------------------------------------------------------------------------

def test_idle_counts_from_the_first_idle_tick_and_fires_once_per_stretch():
    c = cfg(idle_s=600)
    first = d.decide(c, seen(), T0)
    assert first.state["idle_since"] == T0 and first.state["fires_at"]["idle"] == T0 + 600
    assert d.decide(c, seen(), T0 + 599.9, first.memory).reason is None
    fired = d.decide(c, seen(), T0 + 600, first.memory)
    assert fired.reason == "idle" and fired.detail.startswith("idle for 600s (no job, GPU absent")
    after = d.decide(c, seen(), T0 + 10 ** 5, fired.memory)
    assert after.reason is None and "idle" not in after.state["fires_at"]  # not again in this stretch
    work = d.decide(c, seen(runs=[job()]), T0 + 10 ** 5 + 1, after.memory)  # something happened
    assert work.state["idle_since"] is None
    anew = d.decide(c, seen(), T0 + 10 ** 5 + 2, work.memory)
    assert anew.state["idle_since"] == T0 + 10 ** 5 + 2 and not anew.memory.idle_fired


def test_a_gpu_at_the_threshold_is_at_work():
    c = cfg(idle_s=60, gpu_idle_percent=5)
    assert d.decide(c, seen(gpu=5), T0).state["idle_since"] is None
    assert d.decide(c, seen(gpu=4.9), T0).state["idle_since"] == T0


def test_a_counted_login_holds_idle_off_and_its_last_input_starts_the_stretch():
    c = cfg(idle_s=600)
    start = d.decide(c, seen(), T0)
    typing = seen(logins=("/run/utmp", [login(T0 + 50)], []))
    held = d.decide(c, typing, T0 + 10 ** 4, start.memory)  # a login long past the limit: not idle
    assert held.reason is None and held.state["idle_since"] == T0 + 50
    gone = d.decide(c, seen(), T0 + 649.9, held.memory)
    assert gone.reason is None
    assert d.decide(c, seen(), T0 + 650, held.memory).reason == "idle"  # idle_s after the last keystroke


def test_a_keystroke_from_the_future_counts_as_now():
    """A utmp time ahead of the clock (set back since) must not push idle away by that much."""
    c = cfg(idle_s=600)
    ahead = d.decide(c, seen(logins=("/run/utmp", [login(T0 + 10 ** 6)], [])), T0)
    assert ahead.state["idle_since"] == T0
    assert d.decide(c, seen(), T0 + 600, ahead.memory).reason == "idle"


def test_ignored_logins_are_named_in_the_idle_detail():
    ignored = [{"why": "tmux pane"}, {"why": "tmux pane"}]
    out = d.decide(cfg(idle_s=1), seen(logins=("/run/utmp", [], ignored)), T0 + 5, d.decide(cfg(idle_s=1), seen(), T0).memory)
    assert out.reason == "idle" and out.detail.endswith("no interactive login; not counted: 2 tmux pane)")


def test_no_idle_limit_never_fires():
    first = d.decide(cfg(idle_s=0), seen(), T0)
    assert d.decide(cfg(idle_s=0), seen(), T0 + 10 ** 7, first.memory).reason is None


# --- heartbeats ---------------------------------------------------------------------------------------------

def test_a_fresh_heartbeat_is_work_and_a_stale_one_is_forgotten():
    c = cfg(idle_s=60, heartbeat_stale_s=20)
    fresh = d.decide(c, seen(heartbeats={"train-ab": T0 - 19.9}), T0)
    assert fresh.state["busy"] == ["train-ab"] and fresh.state["idle_since"] is None and fresh.forget == []
    stale = d.decide(c, seen(heartbeats={"train-ab": T0 - 20}), T0)
    assert stale.state["busy"] == [] and stale.forget == ["train-ab"] and stale.state["idle_since"] == T0
    assert stale.notes == ["gpuctl command train-ab: no heartbeat for 20s, no longer counted"]


def test_a_heartbeat_far_in_the_future_does_not_keep_the_instance_busy():
    """The clock was set back after the file was touched: it would count as work (and keep the
    bill running) until the clock caught up, an hour here."""
    c = cfg(idle_s=60, heartbeat_stale_s=20)
    out = d.decide(c, seen(heartbeats={"push-1": T0 + 3600, "push-2": T0 + 5}), T0)
    assert out.state["busy"] == ["push-2"] and out.forget == ["push-1"]
    assert out.notes == ["gpuctl command push-1: its heartbeat is 3600s ahead of this clock, no longer counted"]


# --- what firing does: spot notice, neighbours -----------------------------------------------------------

def test_a_notice_during_a_poweroff_stops_the_jobs_only():
    c = cfg(hard_cap_at=T0)
    out = d.decide(c, seen(runs=[job()], notice=True), T0)
    assert (out.reason, out.action) == ("hard-cap", "stop-jobs")
    assert out.notes == ["poweroff held back: a spot interruption notice came; EC2 ends the instance"]
    assert out.state["jobs"] == ["r1"]  # the jobs are stopped all the same
    assert d.decide(c, seen(), T0).action == "poweroff"
    assert d.decide(cfg(hard_cap_at=T0, on_fire="stop-jobs"), seen(notice=True), T0).notes == []


@pytest.mark.parametrize("neighbour, held", [
    ((["their-run"], T0 - 179.9), True),
    ((["their-run"], T0 - 180), False),  # its watchdog has not looked for 3 minutes: gone
    (([], T0), False),  # no job
    ((["their-run"], T0 + 100), True),  # a little ahead (the clock was set back): alive
    ((["their-run"], T0 + 10 ** 6), False),  # far ahead: a file from before the clock moved
    ((["their-run"], "garbage"), False),
    ((None, None), False),
], ids=["fresh", "old", "no-jobs", "ahead", "far-ahead", "garbage", "empty"])
def test_a_neighbour_clusters_job_holds_the_poweroff_back(neighbour, held):
    out = d.decide(cfg(hard_cap_at=T0), seen(neighbours={"other": neighbour}), T0)
    assert out.action == ("stop-jobs" if held else "poweroff")
    assert (out.notes == ["poweroff held back: cluster(s) other on this host run jobs"]) == held


def test_nothing_fires_nothing_is_done():
    out = d.decide(cfg(), seen(runs=[job()], gpu=80), T0)
    assert (out.reason, out.detail, out.action, out.notes, out.forget) == (None, None, None, [], [])
    assert out.state["jobs"] == ["r1"]


# --- a watchdog's memory across a restart ----------------------------------------------------------------

@pytest.mark.parametrize("previous, expected", [
    ({"idle_since": T0 + 5, "boot_id": "b", "cluster_key": "k"}, T0 + 5),
    ({"idle_since": T0 - 500, "boot_id": "b", "cluster_key": "k"}, T0),  # never before this cluster started
    ({"idle_since": T0 + 5, "boot_id": "old", "cluster_key": "k"}, None),  # before a reboot
    ({"idle_since": T0 + 5, "boot_id": "b", "cluster_key": "other"}, None),  # an earlier cluster's
    ({"idle_since": "soon", "boot_id": "b", "cluster_key": "k"}, None),
    ([1, 2], None),
], ids=["same", "before-start", "other-boot", "other-cluster", "garbage", "not-a-dict"])
def test_the_idle_time_a_previous_watchdog_counted(previous, expected):
    assert d.inherited_idle_since(previous, cfg(cluster_key="k"), "b") == expected



# --- edges scripts/mutate found unchecked (each a mutant the tests above let live) ----------------

@pytest.mark.parametrize("data, want", [
    ({"at": 7}, 7.0), ({}, 5.0), ({"at": "x"}, 5.0), ({"at": None}, 5.0),
    ({"at": "nan"}, 5.0), ({"at": "inf"}, 5.0), ({"at": "-inf"}, 5.0)])
def test_a_number_from_the_instance_is_finite_or_the_default(data, want):
    assert d.number(data, "at", 5) == want


def test_a_cluster_with_no_start_yet_has_spent_nothing_and_counts_its_budget_from_now():
    out = d.decide(cfg(started_at=None, budget_usd=1.0), seen(), T0)
    assert out.state["spent_usd"] == 0.0 and out.state["budget_usd"] == 1.0
    assert out.state["fires_at"]["budget"] == pytest.approx(T0 + 1000, abs=1e-6)


def test_the_budget_fires_at_its_exact_time_under_a_dollar_an_hour_too():
    out = d.decide(cfg(budget_usd=1.0, usd_per_hour=0.5), seen(), T0)
    assert out.state["fires_at"]["budget"] == pytest.approx(T0 + 7200, abs=1e-6)


@pytest.mark.parametrize("age, said", [
    (20.0, "no heartbeat for 20s"), (0.0, "no heartbeat for 0s"), (0.4, "no heartbeat for 0s"),
    (-5.0, "its heartbeat is 5s ahead of this clock")])
def test_a_stale_heartbeats_age_is_said_either_way_on_the_clock(age, said):
    assert d._beat_age(age) == said


def test_a_heartbeat_exactly_the_stale_limit_ahead_is_stale():
    out = d.decide(cfg(heartbeat_stale_s=20), seen(heartbeats={"push-1": T0 + 20}), T0)
    assert out.state["busy"] == [] and out.forget == ["push-1"]


@pytest.mark.parametrize("fired, fires", [
    ({"reason": "run-done", "at": T0 + 200}, False),  # fired for this run already (at its very end)
    ({"reason": "run-done"}, True),  # a firing that says no time: not for this run
    ({"reason": "budget", "at": T0 + 300}, True),
])
def test_run_done_and_the_firing_it_already_did(fired, fires):
    c = cfg(down_after_run=True, down_after_run_since=T0 + 100)
    out = d.decide(c, seen(runs=[job(running=False, ended_at=T0 + 200)], fired=fired), T0 + 260)
    assert (out.reason == "run-done") == fires
    if fires:
        assert out.detail == "the run ended 60s ago"


def test_run_done_near_the_clocks_zero_reads_a_firing_without_a_time_as_none():
    c = cfg(started_at=0.0, down_after_run=True, down_after_run_since=0.0)
    out = d.decide(c, seen(runs=[job(running=False, ended_at=0.5)], fired={"reason": "run-done"}), 100.0)
    assert out.reason == "run-done"


def test_a_one_second_stall_limit_counts_and_a_job_without_a_log_is_not_silent():
    c = cfg(stall_s=1)
    assert d.decide(c, seen(runs=[job(log_mtime=T0 - 1)], gpu=0), T0).state["stalled"] == ["r1"]
    assert d.decide(c, seen(runs=[job(log_mtime=None)], gpu=0), T0).state["stalled"] == []


def test_idle_fires_once_per_stretch_however_many_ticks_follow():
    c = cfg(idle_s=600)
    memory = d.decide(c, seen(), T0).memory
    fired = d.decide(c, seen(), T0 + 600, memory)
    assert fired.reason == "idle"
    memory = fired.memory
    for t in (T0 + 700, T0 + 800, T0 + 900):
        out = d.decide(c, seen(), t, memory)
        assert out.reason is None
        memory = out.memory


def test_a_counted_login_after_idle_fired_starts_a_new_stretch():
    """Someone logged in after the idle firing (stop-jobs: the instance lives on): once they leave,
    idle fires again idle_s after their last keystroke."""
    c = cfg(idle_s=600, on_fire="stop-jobs")
    fired = d.decide(c, seen(), T0 + 600, d.decide(c, seen(), T0).memory)
    assert fired.reason == "idle"
    typing = d.decide(c, seen(logins=("/run/utmp", [login(T0 + 1000)], [])), T0 + 1000, fired.memory)
    assert typing.reason is None and not typing.memory.idle_fired
    assert d.decide(c, seen(), T0 + 1600, typing.memory).reason == "idle"


def test_a_login_that_says_no_last_input_leaves_the_stretch_where_it_was():
    c = cfg(idle_s=600)
    start = d.decide(c, seen(), T0)
    entry = {"user": "u", "line": "pts/0", "host": "h", "quiet_s": 0}
    out = d.decide(c, seen(logins=("/run/utmp", [entry], [])), T0 + 100, start.memory)
    assert out.state["idle_since"] == T0


def test_the_idle_detail_says_the_gpus_use_and_nothing_more_without_ignored_logins():
    c = cfg(idle_s=60, gpu_idle_percent=10)
    out = d.decide(c, seen(gpu=4.4), T0 + 60, d.decide(c, seen(gpu=4.4), T0).memory)
    assert out.detail == "idle for 60s (no job, GPU 4%, no interactive login)"


def test_every_busy_neighbour_is_named_when_the_poweroff_is_held_back():
    out = d.decide(cfg(hard_cap_at=T0), seen(neighbours={"b": (["x"], T0), "a": (["y"], T0)}), T0)
    assert out.notes == ["poweroff held back: cluster(s) a, b on this host run jobs"]


def test_the_state_names_the_queued_runs():
    out = d.decide(cfg(), seen(runs=[job("r1"), job("r2", queued=True)], gpu=80), T0)
    assert out.state["jobs"] == ["r1", "r2"] and out.state["queued"] == ["r2"]


def test_a_previous_idle_time_near_the_clocks_zero_counts_for_a_cluster_with_no_start():
    previous = {"idle_since": 0.5, "boot_id": "b", "cluster_key": "k"}
    assert d.inherited_idle_since(previous, cfg(cluster_key="k", started_at=None), "b") == 0.5

def test_the_watchdog_files_hold_every_payload_the_watchdog_imports():
    """The aws user data carries WATCHDOG_FILES alone (the watchdog runs from boot, before any
    push): a payload one of them imports and the list lacks would stop it there."""
    payloads = {p.stem for p in PAYLOAD_DIR.glob("gpuctl_*.py")}
    for name in WATCHDOG_FILES:
        tree = ast.parse((PAYLOAD_DIR / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {f"{m}.py" for m in imported & payloads} <= set(WATCHDOG_FILES), name
    assert WATCHDOG_FILES[0] == "gpuctl_watchdog.py"  # the entry point the unit and the loop start


def test_a_spot_notice_makes_the_watchdog_sigterm_its_running_jobs(tmp_path, imds):
    """The notice thread's wiring to the observe side (Run records, job names): the real watchdog
    code and a real process group; only the tmux pane lookups are answered here (no tmux server
    in the fast tier: the sshd tests run the real one)."""
    import json
    import signal
    import subprocess

    import gpuctl_notice
    import gpuctl_watchdog as wd

    guard = tmp_path / "guard"
    guard.mkdir()
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "job.sh").write_text("")
    (tmp_path / "runs" / "r0").mkdir()
    (tmp_path / "runs" / "r0" / "job.sh").write_text("")
    (tmp_path / "runs" / "r0" / "exitcode").write_text("0\n")  # over: not signalled
    (guard / "config.json").write_text(json.dumps({"runs_dir": str(tmp_path / "runs"), "tmux_socket": "none",
                                                   "notice": {"endpoint": imds.url(), "interval_s": 0.5}}))
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)  # leads its group, as a pane does

    class Dog(wd.Watchdog):
        def pane(self, cfg, name):
            return {"dead": False, "status": "", "signal": "", "time": ""}

        def pane_pid(self, cfg, name):
            return str(job.pid) if name == "r1" else ""

    dog = Dog(str(guard / "config.json"))
    assert [(r.name, r.running) for r in dog.runs(dog.config())] == [
        ("r0", False), ("r1", True)]
    gpuctl_notice.start(dog, wd.read_json, wd.write_json)
    imds.interrupt()
    try:
        assert job.wait(timeout=20) == -signal.SIGTERM
    finally:
        job.kill()
    assert json.loads((guard / "notice.json").read_text())["action"] == "terminate"
    wait_for(lambda: "stopping 1 job(s)" in (guard / "decisions.log").read_text(), 20, "the notice's stop logged")
    assert "NOTICE spot interruption: terminate" in (guard / "decisions.log").read_text()
