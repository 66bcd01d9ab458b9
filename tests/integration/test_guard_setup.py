"""How guards are set up and owned: a host used by an earlier cluster
lends the next one none of its limits; `train --budget` is that run's own budget, not the
cluster's uptime budget; a watchdog that cannot start fails `up` loudly; a `train` racing a
`down` never leaves a job that `down` did not see. Real sshd hosts and real tmux, with plain-Python jobs.

Bad inputs tried: a Python that does not exist for the watchdog, a run budget far below the
cluster's uptime so far, a train and a down started together, idle limits shorter than the check
interval in force (by `guard set`, `train` and `up`: each refused before anything changed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time


import pytest

from tests.conftest import MARK, QUICK_TRAIN
from gpuctl.remote.local import LocalHost
from tests.integration.test_deadlines import marked
from tests.integration.test_guards import decisions, fired, marks, ticks, wait_for
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT, gpuctl_tmux

GPUCTL = [sys.executable, "-m", "gpuctl"]


def test_a_new_cluster_on_a_used_host_starts_from_its_own_settings(gpuctl, ssh, monkeypatch, tmp_path):
    host = ssh.hosts[0]
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "10s", "ON_FIRE": "poweroff",
                       "POWEROFF_COMMAND": f"date +%s >> {MARK}"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    up_ssh(gpuctl, ssh)
    gpuctl("down", "-y")
    for key in ("CHECK_INTERVAL", "IDLE", "ON_FIRE", "POWEROFF_COMMAND"):
        monkeypatch.delenv(f"GPUCTL_GUARDS__{key}")
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path / "a fresh home"))
    up_ssh(gpuctl, ssh)  # the same name from another home: the same work dir on the host
    cfg = json.loads(gpuctl("guard", "show", "--json").stdout)["config"]
    assert cfg["idle_s"] == 1800 and cfg["check_interval_s"] == 60 and cfg["on_fire"] == "stop-jobs"
    time.sleep(12)  # the old 10 s idle limit would have fired by now
    assert marks(host) == [] and fired(host) is None


def test_a_watchdog_that_cannot_start_fails_up_loudly(gpuctl, ssh, monkeypatch):
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/nonexistent/python3")
    res = up_ssh(gpuctl, ssh, code=7)
    assert "the watchdog on root@" in res.stderr and "did not start" in res.stderr
    assert "No such file" in res.stderr or "not found" in res.stderr  # what the watchdog printed


# A custom loop reporting through gpuctl_report: the run's budget is kept by the same report
# writer the Keras hook uses (that hook's own stop: test_payload_tf.py test_budget_stops_training_gracefully).
EPOCHS = """
import sys, time
import gpuctl_report
for _ in range(int(sys.argv[1])):
    time.sleep(0.1)
    gpuctl_report.report_epoch(examples=100)
print("all epochs done", flush=True)
"""


def test_train_budget_is_the_runs_own_and_is_forgotten_with_it(gpuctl, make_project, isolated):
    """At $7200/h the cluster's uptime passes $2 within a second; `--budget 2` used to kill the run
    with 0 epochs (it set the cluster's uptime budget). It must train epochs until that run's own
    epochs reach $2, and the next run has no budget."""
    gpuctl("up", "--usd-per-hour", "7200", "-y")
    time.sleep(1.5)  # the cluster's uptime is past $2 before the run starts
    proj = make_project("budget", {"train.py": EPOCHS})
    gpuctl("train", proj, "--budget", "2", "--wait", "--", "300")
    first = json.loads(gpuctl("cost", "--json").stdout)["runs"][-1]
    assert first["state"] == "succeeded" and 1 <= first["epochs_done"] < 300
    # The payload stops before an epoch that would pass the budget (the first cannot be foreseen).
    assert first["spent_usd"] - first["epochs"][-1]["epoch_cost_usd"] <= 2.0
    logs = gpuctl("logs", first["run_id"]).stdout
    assert "budget of $2.0000 reached" in logs and "all epochs done" not in logs
    guard = json.loads(gpuctl("guard", "show", "--json").stdout)
    assert guard["config"]["budget_usd"] == 0  # the cluster's uptime budget was never set
    gpuctl("train", proj, "--wait", "--", "3")
    second = json.loads(gpuctl("cost", "--json").stdout)["runs"][-1]
    assert second["state"] == "succeeded" and second["epochs_done"] == 3


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_a_train_racing_a_down_leaves_no_invisible_job(gpuctl, make_project, isolated, monkeypatch):
    """`train & sleep; down -y`: either the train starts first and down stops its run, or it waits
    and is refused; never a job running after down said the jobs ended."""
    gpuctl("up")
    # A project big enough that its push is still going when down starts.
    files = {f"data/f{i}.bin": "x" * 20000 for i in range(1500)}
    files["train.py"] = "import time\ntime.sleep(60)\n"
    proj = make_project("racer", files)
    train = subprocess.Popen([*GPUCTL, "train", str(proj)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    down = subprocess.run([*GPUCTL, "down", "-y"], capture_output=True, text=True, timeout=120)
    out, err = train.communicate(timeout=120)
    assert down.returncode == 0, down.stderr
    runs = json.loads(gpuctl("status", "--json").stdout)["runs"]
    if train.returncode == 0:  # it started first: down saw and stopped its run
        assert [r["state"] for r in runs] == ["stopped"], (out, err, down.stdout)
    else:
        # It waited and found the cluster down, or (down waits 5 s at most for its lock) it was
        # still pushing when down went ahead, and then started nothing.
        assert train.returncode == 4 and "was released" in err, err
        assert all(r["state"] != "running" for r in runs), runs
    # Every process of the cluster's jobs carries its mark (the job's source text is in no
    # process's command line: a pgrep for it could not fail).
    socket = LocalHost(isolated / "clusters" / "default").tmux_socket
    wait_for(lambda: not marked(socket), timeout=5)  # a job left would live 60 s


def test_idle_time_left_on_a_host_by_an_earlier_cluster_never_counts(gpuctl, ssh, monkeypatch):
    """A new `up` on a host used before fired at once: the watchdog restored `idle_since` from an
    old state.json. Here the old file says this boot and cluster number 1 (a fresh gpuctl home
    numbers its clusters from 1 again): idle still counts from this cluster's start only."""
    host = ssh.hosts[0]
    boot = host.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    old = {"idle_since": time.time() - 1000, "boot_id": boot, "cluster_key": "1-an-earlier-up",
           "at": time.time() - 900}
    host.run(f"mkdir -p {ROOT}/guard && echo '{json.dumps(old)}' > {ROOT}/guard/state.json")
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "8s", "ON_FIRE": "poweroff",
                       "POWEROFF_COMMAND": f"date +%s >> {MARK}"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    t0 = time.time()
    up_ssh(gpuctl, ssh)
    # The old file would have fired on the first look: two looks of this cluster's watchdog (the
    # second comes after a fire of the first would have ended) decided nothing.
    def two_looks() -> list[str] | None:
        looks = [d for t, d in ticks(decisions(host)) if t >= t0 - 1]  # its stamps are to the second
        return looks[:2] if len(looks) >= 2 else None

    assert wait_for(two_looks, 30, "two looks of this cluster's watchdog") == ["ok", "ok"]
    assert fired(host) is None and marks(host) == []
    state = json.loads(gpuctl("guard", "show", "--json").stdout)["state"]
    assert state["idle_since"] >= t0 - 2 and state["boot_id"] == boot


def test_limits_are_checked_against_the_interval_in_force_on_the_instance(gpuctl, ssh, make_project, monkeypatch):
    """Before: `guard set --idle 5s` on an instance checking every second was refused for the
    default 60 s interval, and `--idle 500ms` passed on an instance checking every minute."""
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    # `up` refuses limits its own watchdog could not notice, before it creates anything.
    monkeypatch.setenv("GPUCTL_GUARDS__STALL", "10s")
    res = up_ssh(gpuctl, ssh, code=3)
    assert "guards.stall (10s) is shorter than check_interval (60s)" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    monkeypatch.setenv("GPUCTL_GUARDS__STALL", "0")
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "1s")
    up_ssh(gpuctl, ssh)
    monkeypatch.delenv("GPUCTL_GUARDS__CHECK_INTERVAL")  # the default (60 s) from here on
    cfg = json.loads(gpuctl("guard", "set", "--idle", "5s", "--json").stdout)["config"]
    assert cfg["idle_s"] == 5 and cfg["check_interval_s"] == 1
    gpuctl("guard", "set", "--check-interval", "2m", "--idle", "10m")
    before = host.run(f"cat {ROOT}/guard/config.json").stdout
    res = gpuctl("guard", "set", "--idle", "30s", code=3)
    assert "guards.idle (30s) is shorter than check_interval (120s) in force on box" in res.stderr
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "30s")
    proj = make_project("quick", {"train.py": QUICK_TRAIN})
    res = gpuctl("train", proj, "--allow-cpu", code=3)
    assert "in force on box" in res.stderr
    assert host.run(f"cat {ROOT}/guard/config.json").stdout == before
    assert host.run(f"ls {ROOT}/runs 2>/dev/null").stdout.strip() == ""  # nothing started or pushed
    assert host.run(f"ls {ROOT}/code 2>/dev/null").stdout.strip() == ""


def test_guard_show_check_shows_each_guards_inputs_live_and_changes_nothing(gpuctl, fast_guards, monkeypatch):
    """`guard show --check`: the watchdog's own code looks once on the instance and says what it
    sees and would decide now, and whether firing can work there (a poweroff command that does
    not exist is a bad input tried: flagged, never run)."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "1h")
    up_ssh(gpuctl, fast_guards)
    result = json.loads(gpuctl("guard", "show", "--check", "--json").stdout)["checks"][0]["result"]
    assert result["would_fire"] is None and result["watchdog"]["alive"]
    assert result["state"]["jobs"] == [] and result["state"]["idle_since"] > 0
    assert result["probes"]["utmp"] == "/run/utmp" and result["probes"]["poweroff_found"]
    assert result["probes"]["systemd"] is False  # the test hosts run no systemd: docs/guards.md says what that leaves
    text = gpuctl("guard", "show", "--check").stdout
    assert "would fire now: nothing" in text and "watchdog: pid" in text and "can run" in text
    monkeypatch.setenv("GPUCTL_GUARDS__POWEROFF_COMMAND", "no-such-poweroff --now")
    gpuctl("guard", "set")
    text = gpuctl("guard", "show", "--check").stdout
    assert "`no-such-poweroff --now` WOULD FAIL: command not found" in text
    # With the limit passed the check says it would fire, and fires nothing itself: the watchdog is
    # stopped first, so only the check could have.
    pid = json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout)["pid"]
    host.run(f"{gpuctl_tmux(host)} kill-session -t =gpuctl-watchdog; kill {pid}")
    monkeypatch.setenv("GPUCTL_GUARDS__POWEROFF_COMMAND", f"date +%s.%N >> {MARK}")
    cfg = json.loads(host.run(f"cat {ROOT}/guard/config.json").stdout)
    host.run(f"cat > {ROOT}/guard/config.json <<'X'\n{json.dumps({**cfg, 'idle_s': 1, 'poweroff_command': 'date >> ' + MARK})}\nX")
    wait_for(lambda: host.run(f"kill -0 {pid}").returncode != 0, timeout=10)  # it writes no more lines
    log_before = host.run(f"cat {ROOT}/guard/decisions.log").stdout

    def idle_past_the_limit() -> str | None:  # 1 s: a check's own look, which fires nothing
        out = gpuctl("guard", "show", "--check").stdout
        return out if "would fire now: idle" in out else None

    text = wait_for(idle_past_the_limit, timeout=30)
    assert "would fire now: idle (idle for" in text and "watchdog: NOT RUNNING" in text, text
    assert marks(host) == [] and fired(host) is None
    assert host.run(f"cat {ROOT}/guard/decisions.log").stdout == log_before


def test_a_watchdog_running_older_code_is_restarted_with_the_pushed_code(gpuctl, fast_guards, monkeypatch):
    """After an upgrade of gpuctl, the watchdog already running on an instance must not keep the
    old code (one from before heartbeats takes a push for idleness)."""
    from gpuctl.ops.guards import code_version

    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    state = lambda: json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout)  # noqa: E731
    assert state()["code"] == code_version()
    # An "older" watchdog: its file differs from what this gpuctl pushes; its loop restarts it.
    host.run(f"echo '# older' >> {ROOT}/payload/gpuctl_watchdog.py; kill {state()['pid']}")
    old = wait_for(lambda: (s := state())["code"] != code_version() and s)
    gpuctl("guard", "set")
    new = state()
    assert new["code"] == code_version() and new["pid"] != old["pid"]
    assert host.run(f"kill -0 {old['pid']}").returncode != 0


def test_a_second_train_finds_its_watchdog_running_and_only_writes_its_limits(gpuctl, make_project, isolated):
    """Before, every train re-installed a running watchdog (a systemd or tmux probe, its
    start script, cron: SSH round trips each) and asked twice whether it lived. A watchdog that
    runs this code needs only the new limits: it rereads its config every second."""
    gpuctl("up", "--provider", "local")
    proj = make_project("quick", {"train.py": QUICK_TRAIN})
    first = gpuctl("train", proj, "--wait").stderr
    assert "watchdog: tmux session gpuctl-watchdog" in first
    pid = json.loads(gpuctl("guard", "show", "--json").stdout)["state"]["pid"]
    second = gpuctl("train", proj, "--wait", "--down").stderr
    assert f"watchdog: running (pid {pid}), limits updated" in second  # the same watchdog, not restarted
    guard = json.loads(gpuctl("guard", "show", "--json").stdout)
    assert guard["config"]["down_after_run"] is True  # the new limit is in force
