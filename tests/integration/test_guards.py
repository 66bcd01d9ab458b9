"""The watchdog on real sshd test hosts, with intervals of a second or two, `on_fire = poweroff`
and a poweroff command that only leaves a mark in the host's own /srv.

Bad inputs tried: a duration like "5 parsecs", a negative budget, an idle limit shorter than the
check interval (each refused, the instance's config unchanged)."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.test_payload_tf import MODEL
from tests.integration.test_ssh import up_ssh

MARK = "/srv/POWEROFF"


@pytest.fixture
def fast_guards(ssh, monkeypatch):
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "3s", "STALL": "0", "GRACE": "2s", "ON_FIRE": "poweroff",
                       "POWEROFF_COMMAND": f"date +%s.%N >> {MARK}"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    return ssh


def wait_for(check, timeout=40, every=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def fired(host):
    res = host.run("cat /srv/gpuctl/guard/fired.json")
    return json.loads(res.stdout) if res.returncode == 0 and res.stdout.strip() else None


def marks(host):
    return host.run(f"cat {MARK} 2>/dev/null").stdout.split()


def test_idle_fires_within_one_interval_after_the_limit(gpuctl, fast_guards):
    host = fast_guards.hosts[0]
    t_up = time.time()
    out = up_ssh(gpuctl, fast_guards).stderr
    assert "watchdog: tmux session gpuctl-watchdog" in out
    f = wait_for(lambda: fired(host))
    assert f["reason"] == "idle" and f["action"] == "poweroff"
    assert marks(host), "the poweroff command ran"
    # idle for 3 s, checked every 1 s: it fires between 3 and 4 s (+ start-up) after it began.
    log = host.run("cat /srv/gpuctl/guard/decisions.log").stdout
    assert "FIRE idle: idle for" in log and "-> poweroff" in log
    assert 3.0 <= f["at"] - t_up <= 3.0 + 1.0 + 6.0
    status = gpuctl("status").stdout
    assert "guard FIRED: idle" in status
    assert "FIRE idle" in gpuctl("logs", "--guard").stdout


def fire_times(host, reason):
    import datetime as dt

    out = []
    for line in host.run("cat /srv/gpuctl/guard/decisions.log").stdout.splitlines():
        stamp, _, text = line.partition(" ")
        if text.startswith(f"FIRE {reason}"):
            out.append(dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp())
    return out


def test_never_fires_while_training_then_idle_after(gpuctl, fast_guards, make_project):
    host = fast_guards.hosts[0]
    up_ssh(gpuctl, fast_guards)
    proj = make_project("busy", {"train.py": "import time\nfor i in range(16):\n    print(i, flush=True)\n    time.sleep(0.5)\n"})
    res = gpuctl("train", proj, "--allow-cpu", "--wait")
    assert "15" in res.stdout
    start = float(host.run("stat -c %Y /srv/gpuctl/runs/*/job.sh").stdout.split()[0])
    end = float(host.run("stat -c %Y /srv/gpuctl/runs/*/exitcode").stdout.split()[0])
    assert end - start >= 7
    # Once the run is over, idle fires again after its 3 s (+ one 1 s interval).
    after = wait_for(lambda: [t for t in fire_times(host, "idle") if t >= end])
    assert end + 3 - 1 <= after[0] <= end + 3 + 1 + 2
    # And never while it trained (second-resolution log stamps: a second of slack each side).
    assert not [t for t in fire_times(host, "idle") if start + 1 < t < end - 1]


def test_budget_stops_the_job_gracefully_then_fires(gpuctl, fast_guards, make_project, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    monkeypatch.setenv("GPUCTL_GUARDS__GRACE", "20s")
    up_ssh(gpuctl, fast_guards, extra=("--usd-per-hour", "3600"))  # $1 a second
    script = MODEL + (
        "import os\n"
        "model.fit(x, y, epochs=100000, verbose=0)\n"
        "open(os.path.join(os.environ['GPUCTL_OUTPUT_DIR'], 'checkpoint.txt'), 'w').write('saved')\n"
        "print('checkpoint written', flush=True)\n"
    )
    proj = make_project("costly", {"train.py": script})
    gpuctl("guard", "set", "--budget", "20")
    run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json").stdout)["run"]["run_id"]
    f = wait_for(lambda: fired(host), timeout=90)
    assert f["reason"] == "budget"
    wait_for(lambda: marks(host))  # powered off once the job had stopped
    assert host.run(f"cat /srv/gpuctl/runs/{run_id}/outputs/checkpoint.txt").stdout == "saved"  # its hook ran
    run = wait_for(lambda: next((r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]
                                 if r["state"] != "running"), None), every=1)
    assert run["state"] == "stopped" and run["exit_code"] == 143  # SIGTERM, after a graceful exit
    assert "checkpoint written" in gpuctl("logs", run_id).stdout


@pytest.mark.parametrize("exit_code", [0, 3])
def test_down_fires_after_success_and_after_failure_with_the_client_gone(gpuctl, fast_guards, make_project,
                                                                        monkeypatch, exit_code):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    proj = make_project("once", {"train.py": f"import sys, time\ntime.sleep(2)\nsys.exit({exit_code})\n"})
    gpuctl("train", proj, "--allow-cpu", "--down")
    # From here on the client does nothing at all: only the host's own files are looked at.
    f = wait_for(lambda: fired(host), timeout=60)
    assert f["reason"] == "run-done"
    end = float(host.run("stat -c %Y /srv/gpuctl/runs/*/exitcode").stdout.split()[0])
    assert f["at"] >= end + 2.0 - 1.0  # after the grace period
    assert marks(host)


def test_watchdog_killed_with_sigkill_comes_back(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)

    def pid():
        # The Python process itself, not the shell loop around it that restarts it.
        found = host.pids(rb"^\S*python\S* \S*gpuctl_watchdog\.py")
        return found[0] if found else None

    first = wait_for(pid)
    host.run(f"kill -9 {first}")
    second = wait_for(lambda: (p := pid()) and p != first and p)
    assert second != first
    log = host.run("cat /srv/gpuctl/guard/decisions.log").stdout
    assert log.count("watchdog started") == 2


def test_guard_set_and_show_and_bad_values_change_nothing(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    report = json.loads(gpuctl("guard", "set", "--idle", "30m", "--budget", "20", "--json").stdout)
    assert report["config"]["idle_s"] == 1800 and report["config"]["budget_usd"] == 20
    before = host.run("cat /srv/gpuctl/guard/config.json").stdout
    for args, needle in [(["--idle", "5 parsecs"], "not a duration"),
                         (["--budget", "-1"], "guards.budget_usd"),
                         (["--idle", "10s", "--check-interval", "1m"], "shorter than check_interval")]:
        res = gpuctl("guard", "set", *args, code=3)
        assert needle in res.stderr and "Traceback" not in res.stderr
        assert host.run("cat /srv/gpuctl/guard/config.json").stdout == before
    shown = gpuctl("guard", "show").stdout
    assert "idle" in shown and "30m" in shown and "$20" in shown
