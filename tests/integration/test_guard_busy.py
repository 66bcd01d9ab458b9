"""gpuctl's own work is not idleness, on real sshd hosts with utmp: a command
that works on the instance (push, preflight, exec, ssh) keeps a heartbeat file fresh there, and
the watchdog counts it as activity until it goes stale (gpuctl.remote.heartbeat).

Before: with `idle=20s` a 64 MB push fired poweroff mid-push, and `gpuctl exec -- sleep 35` and
`gpuctl ssh -- sleep 35` fired mid-command. Bad case tried: the client killed with SIGKILL in the
middle of a command (a laptop that vanished): its heartbeat stops counting once stale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from gpuctl.remote import heartbeat
from tests.conftest import QUICK_TRAIN
from tests.integration.test_guards import GPUCTL, decisions, fire_times, fired, marks, ticks, wait_fired, wait_for
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT

# A run longer than the idle limits here (4 epochs of 1.5 s), reporting as a Keras fit would: what
# keeps the watchdog from firing is that a run is going, not TensorFlow.
LONGER_THAN_IDLE = QUICK_TRAIN.replace("time.sleep(0.2)", "time.sleep(1.5)")
assert LONGER_THAN_IDLE != QUICK_TRAIN


def test_exec_and_ssh_commands_longer_than_the_idle_limit_never_look_idle(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "3s")
    up_ssh(gpuctl, fast_guards)
    for argv in (("exec", "--", "sleep", "8"), ("ssh", "--", "sleep", "8")):
        begin = time.time()
        gpuctl(*argv)
        end = time.time()
        assert not [t for t in fire_times(host, "idle") if begin + 1 < t < end - 1], decisions(host)
        assert f"gpuctl at work: {'exec' if argv[0] == 'exec' else 'ssh'}-" in decisions(host)
        assert host.run(f"ls {ROOT}/guard/busy").stdout.strip() == ""  # the command took its file away
        # Once it is over, the instance is idle again: fires within the limit (+ an interval).
        f = wait_fired(host)
        assert f["reason"] == "idle" and end + 3 - 1 <= f["at"] <= end + 3 + 1 + 2, f["at"] - end
        host.run(f"rm -f {ROOT}/guard/fired.json")


@pytest.mark.preflight  # its first train's preflight imports TensorFlow: longer than the idle limit
def test_up_then_train_wait_then_nothing_fires_only_after_the_run(gpuctl, fast_guards, make_project, monkeypatch):
    """Acceptance 2: idle=4s, check every 1 s. The push and the preflight (TensorFlow's import takes
    longer than the limit) are not idle; the run is not; idle fires ~4 s after it ends."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "4s")
    t_up = time.time()
    up_ssh(gpuctl, fast_guards)
    proj = make_project("four", {"train.py": LONGER_THAN_IDLE})
    run = json.loads(gpuctl("train", proj, "--allow-cpu", "--wait", "--json", "--", "--epochs", "4").stdout)["run"]
    assert run["state"] == "succeeded"
    end = float(host.run(f"cat {ROOT}/runs/{run['run_id']}/ended").stdout)
    assert not [t for t in fire_times(host, "idle") if t < end - 1], decisions(host)
    assert "gpuctl at work: train-" in decisions(host)
    f = wait_fired(host)
    print(f"figure: `up` to run end {end - t_up:.1f}s with no idle firing; idle fired {f['at'] - end:.1f}s after")
    assert f["reason"] == "idle" and end + 4 - 1 <= f["at"] <= end + 4 + 1 + 3, f["at"] - end
    assert marks(host)


IDLE_S = 10


def test_a_client_killed_mid_command_stops_counting_once_its_heartbeat_is_stale(fast_guards, gpuctl, monkeypatch):
    host = fast_guards.hosts[0]
    # Idle must not fire between `up` and the client's first beat: a `gpuctl exec` starting on a
    # loaded machine took over 3 s to get there once.
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", f"{IDLE_S}s")
    up_ssh(gpuctl, fast_guards)
    client = subprocess.Popen([*GPUCTL, "exec", "--", "sleep", "120"], env=dict(os.environ),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: host.run(f"ls {ROOT}/guard/busy").stdout.strip(), timeout=20)
        t_busy = time.time()
        # A look of the watchdog's well past the idle limit (its stamps are to the second) decided nothing:
        looks = wait_for(lambda: [t for t in ticks(decisions(host)) if t[0] >= t_busy + IDLE_S + 2], timeout=IDLE_S + 30)
        assert looks and [d for _, d in ticks(decisions(host)) if d != "ok"] == []
        assert not fired(host)  # beats on, past the idle limit
        os.killpg(client.pid, signal.SIGKILL)  # the laptop is gone: nobody removes the file
        t_gone = time.time()
        f = wait_fired(host, timeout=heartbeat.STALE_S + IDLE_S + 20)
    finally:
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
        client.wait()
    assert f["reason"] == "idle"
    print(f"figure: idle fired {f['at'] - t_gone:.1f}s after the client vanished (stale after {heartbeat.STALE_S:.0f}s)")
    assert f["at"] - t_gone <= heartbeat.STALE_S + IDLE_S + 1 + 3
    assert "no heartbeat for" in decisions(host)


def test_quick_runs_are_not_affected_by_heartbeats_on_a_local_cluster(gpuctl, make_project, isolated):
    """The local provider beats too (this machine plays the instance); nothing is left behind."""
    gpuctl("up", "--provider", "local")
    proj = make_project("quick", {"train.py": QUICK_TRAIN})
    run = json.loads(gpuctl("train", proj, "--wait", "--json").stdout)["run"]
    assert run["state"] == "succeeded"
    busy = list(isolated.glob("**/guard/busy/*"))
    assert busy == []
