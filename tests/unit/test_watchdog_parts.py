"""The watchdog's looks and acts on real parts: its runs read from real files and a real tmux
server (a socket of this test's own), a job's pane that died without its exit code, gpuctl's
heartbeats, the neighbour clusters' state, the GPU's use, and what firing does (fired.json, the
jobs stopped, the poweroff command run). gpuctl_decide's judgement is test_watchdog_decide.py's.
Found unchecked by scripts/mutate: no unit test reached these before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from gpuctl.ops.guards import PAYLOAD_DIR

sys.path.insert(0, str(PAYLOAD_DIR))  # the payloads import each other by bare name, as on the instance
import gpuctl_decide  # noqa: E402
import gpuctl_protocol as proto  # noqa: E402
import gpuctl_watchdog as wd  # noqa: E402


class Lab:
    def __init__(self, tmp_path):
        self.root = tmp_path
        self.socket = f"gpuctl-wd-{uuid.uuid4().hex[:8]}"
        self.guard = tmp_path / "work" / "c1" / "guard"
        self.runs = tmp_path / "work" / "c1" / "runs"
        self.guard.mkdir(parents=True)
        self.runs.mkdir()
        self.powered_off = tmp_path / "powered-off"
        self.config = {"runs_dir": str(self.runs), "tmux_socket": self.socket, "grace_s": 0.5,
                       "poweroff_command": f"touch {self.powered_off}", "cluster_key": "k"}
        self.write_config()
        # Panes stay after their command ends, as gpuctl's job sessions do (remain-on-exit).
        self.tmux("new-session", "-d", "-s", "keep", "sleep 600")
        self.tmux("set-option", "-g", "remain-on-exit", "on")

    def write_config(self, **kw):
        (self.guard / "config.json").write_text(json.dumps({**self.config, **kw}))

    def tmux(self, *args):
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True)

    def run_dir(self, name, command=None, exit_code=None, queued=False, log=True):
        d = self.runs / name
        d.mkdir()
        (d / "job.sh").write_text("")
        if log:
            (d / "output.log").write_text("epoch 1\n")
        if exit_code is not None:
            (d / proto.EXIT_CODE_FILE).write_text(f"{exit_code}\n")
        if queued:
            (d / proto.QUEUE_FILE).write_text(json.dumps({"state": "queued"}))
        if command is not None:
            self.tmux("new-session", "-d", "-s", name, command)
        return d

    def dead(self, name):
        out = self.tmux("list-panes", "-t", f"={name}:", "-F", "#{pane_dead}").stdout.strip()
        return out == "1"

    def died(self, name, command):
        """A session `name` whose pane ran `command` and died, with tmux knowing how: tmux 3.3a
        sometimes keeps a dead pane with no status and no signal at all (seen about one time in
        ten here; the watchdog then leaves the code unknown and the run over), so such a pane is
        made again."""
        for _ in range(50):
            self.tmux("new-session", "-d", "-s", name, command)
            _wait(lambda: self.dead(name))
            said = self.tmux("list-panes", "-t", f"={name}:", "-F", "#{pane_dead_status}#{pane_dead_signal}")
            if said.stdout.strip():
                return
            self.tmux("kill-session", "-t", f"={name}")
        raise AssertionError("tmux never said how a pane died")


@pytest.fixture
def lab(tmp_path):
    lab = Lab(tmp_path)
    yield lab
    lab.tmux("kill-server")


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _alive(pid):
    """The process exists and is not a zombie its parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_runs_as_the_watchdog_sees_them(lab):
    done = lab.run_dir("r-done", exit_code=0)
    live = lab.run_dir("r-live", "sleep 600")
    lab.run_dir("r-queued", "sleep 600", queued=True)
    lab.run_dir("r-nolog", "sleep 600", log=False)
    lab.run_dir("r-gone")  # its session is gone and no exit code: over, code unknown
    (lab.runs / "not-a-run").mkdir()  # no job.sh: not gpuctl's
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    got = {r.name: r for r in dog.runs(dog.config())}
    assert sorted(got) == ["r-done", "r-gone", "r-live", "r-nolog", "r-queued"]
    assert got["r-done"] == gpuctl_decide.Run("r-done", False, os.path.getmtime(done / proto.EXIT_CODE_FILE),
                                              False, None)
    assert got["r-live"] == gpuctl_decide.Run("r-live", True, None, False, os.path.getmtime(live / "output.log"))
    assert got["r-queued"].running and got["r-queued"].queued
    assert got["r-nolog"].running and got["r-nolog"].log_mtime is None
    assert got["r-gone"] == gpuctl_decide.Run("r-gone", False, None, False, os.path.getmtime(
        lab.runs / "r-gone" / "output.log"))


@pytest.mark.parametrize("command, code", [("exit 3", 3), ("kill -9 $$", 137)], ids=["exit", "signal"])
def test_a_pane_that_died_without_its_exit_code_is_recorded_by_tmuxs_word(lab, command, code):
    d = lab.run_dir("r-died")
    lab.died("r-died", command)
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    (run,) = dog.runs(dog.config())
    assert (d / proto.EXIT_CODE_FILE).read_text() == f"{code}\n"
    assert not (d / (proto.EXIT_CODE_FILE + ".watchdog.tmp")).exists()
    ended = float((d / "ended").read_text())
    assert abs(ended - time.time()) < 60  # tmux's time of death (or now)
    assert run == gpuctl_decide.Run("r-died", False, os.path.getmtime(d / proto.EXIT_CODE_FILE), False, None)
    assert f"run r-died: its pane died without recording an exit code; tmux says {code}" in (
        lab.guard / "decisions.log").read_text()


def test_a_dry_look_records_no_exit_code(lab):
    d = lab.run_dir("r-died")
    lab.died("r-died", "exit 3")
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    dog.dry = True
    (run,) = dog.runs(dog.config())
    assert not run.running and not (d / proto.EXIT_CODE_FILE).exists() and not (lab.guard / "decisions.log").exists()


def test_heartbeats_and_neighbours_as_found_on_disk(lab):
    busy = lab.guard / "busy"
    busy.mkdir()
    (busy / "train-1").write_text("")
    os.utime(busy / "train-1", (1000.0, 1000.0))
    other = lab.root / "work" / "c2" / "guard"
    other.mkdir(parents=True)
    (other / "state.json").write_text(json.dumps({"jobs": ["x"], "at": 5.0}))
    (lab.root / "work" / "c3" / "guard").mkdir(parents=True)
    (lab.root / "work" / "c3" / "guard" / "state.json").write_text("not json")
    (lab.guard / "state.json").write_text(json.dumps({"jobs": ["mine"], "at": 1.0}))  # its own: not a neighbour
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    assert dog.heartbeats() == {"train-1": 1000.0}
    assert dog.neighbours() == {"c2": (["x"], 5.0)}


@pytest.mark.parametrize("script, want", [
    ("echo 12; echo 87.5", 87.5),
    ("echo 7", 7.0),
    ("echo N/A", None),
    ("echo 90; exit 1", None),
    (None, None),  # no nvidia-smi at all (no GPU)
])
def test_the_gpus_use_is_the_busiest_gpus(tmp_path, monkeypatch, script, want):
    """nvidia-smi is a shell script on this test's own PATH: no GPU exists on these test machines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if script is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    guard = tmp_path / "guard"
    guard.mkdir()
    assert wd.Watchdog(str(guard / "config.json")).gpu_utilization() == want


@pytest.mark.parametrize("action, powered_off", [(proto.POWEROFF, True), (proto.STOP_JOBS, False)])
def test_firing_records_stops_the_jobs_and_powers_off_when_it_says_so(lab, action, powered_off):
    lab.run_dir("r-live", "sleep 600")
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    cfg = dog.config()
    pid = dog.pane_pid(cfg, "r-live")
    assert pid.isdigit()
    decision = gpuctl_decide.Decision("budget", "$1 spent", action, {"jobs": ["r-live"]}, gpuctl_decide.FRESH, [], [])
    before = time.time()
    dog.fire(cfg, decision)
    fired = json.loads((lab.guard / "fired.json").read_text())
    assert (fired["reason"], fired["detail"], fired["action"]) == ("budget", "$1 spent", action)
    assert before <= fired["at"] <= time.time()
    assert lab.tmux("has-session", "-t", "=r-live").returncode != 0  # its session ended
    _wait(lambda: not _alive(pid), timeout=5)  # its process too (tmux reaps it a moment later)
    assert lab.powered_off.exists() == powered_off
    assert f"FIRE budget: $1 spent -> {action}" in (lab.guard / "decisions.log").read_text()


def test_a_job_that_ends_on_term_is_not_killed_again(lab):
    d = lab.run_dir("r-polite", f"trap 'echo 143 > {lab.runs / 'r-polite' / proto.EXIT_CODE_FILE}; exit 143' TERM; "
                               "sleep 600 & wait")
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    cfg = dog.config()
    _wait(lambda: dog.pane_pid(cfg, "r-polite") != "")
    time.sleep(0.2)  # the trap is set
    started = time.monotonic()
    dog.stop_jobs(cfg, ["r-polite"], grace_s=30)
    assert time.monotonic() - started < 10  # it did not wait out the grace: the exit code came
    assert (d / proto.EXIT_CODE_FILE).read_text() == "143\n"


def test_a_tick_observes_decides_records_and_fires(lab):
    """A budget long spent: the tick writes state.json, logs its look, and fires (poweroff here:
    a file touched)."""
    lab.run_dir("r-live", "sleep 600")
    lab.write_config(budget_usd=0.01, usd_per_hour=3.6, started_at=time.time() - 3600, on_fire=proto.POWEROFF)
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    dog.logins = lambda now, idle_s: (None, [], [])  # this machine's own logins are not this test's
    state, reason, detail = dog.tick()
    assert reason == "budget" and detail == "$3.6000 spent of a $0.0100 budget"
    saved = json.loads((lab.guard / "state.json").read_text())
    assert saved["jobs"] == ["r-live"] and saved["cluster_key"] == "k" and saved["pid"] == os.getpid()
    assert saved["fired"]["reason"] == "budget" and saved["idle_since"] is None
    assert lab.powered_off.exists()
    log = (lab.guard / "decisions.log").read_text()
    assert "jobs=1 gpu=" in log and "fire budget" in log
    assert lab.tmux("has-session", "-t", "=r-live").returncode != 0


def test_a_dry_tick_fires_nothing_and_writes_nothing(lab):
    lab.run_dir("r-live", "sleep 600")
    lab.write_config(budget_usd=0.01, usd_per_hour=3.6, started_at=time.time() - 3600)
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    dog.dry = True
    dog.logins = lambda now, idle_s: (None, [], [])
    state, reason, _ = dog.tick()
    assert reason == "budget" and state["jobs"] == ["r-live"]
    assert not (lab.guard / "state.json").exists() and not lab.powered_off.exists()
    assert lab.tmux("has-session", "-t", "=r-live").returncode == 0


def test_a_stale_heartbeat_is_removed_by_the_tick(lab):
    busy = lab.guard / "busy"
    busy.mkdir()
    (busy / "push-1").write_text("")
    os.utime(busy / "push-1", (1000.0, 1000.0))
    dog = wd.Watchdog(str(lab.guard / "config.json"))
    dog.logins = lambda now, idle_s: (None, [], [])
    dog.tick()
    assert not (busy / "push-1").exists()
