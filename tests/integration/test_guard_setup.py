"""Issue 10, the parts about how guards are set up and owned: a host used by an earlier cluster
lends the next one none of its limits; `train --budget` is that run's own budget, not the
cluster's uptime budget; a watchdog that cannot start fails `up` loudly; a `train` racing a
`down` never leaves a job that `down` did not see. Real sshd hosts, real tmux, real TensorFlow.

Bad inputs tried: a Python that does not exist for the watchdog, a run budget far below the
cluster's uptime so far, a train and a down started together."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.integration.test_guards import MARK, fired, marks
from tests.integration.test_payload_tf import MODEL
from tests.integration.test_ssh import up_ssh

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
    up_ssh(gpuctl, ssh, name="next")
    cfg = json.loads(gpuctl("guard", "show", "--json").stdout)["config"]
    assert cfg["idle_s"] == 1800 and cfg["check_interval_s"] == 60 and cfg["on_fire"] == "stop-jobs"
    time.sleep(12)  # the old 10 s idle limit would have fired by now
    assert marks(host) == [] and fired(host) is None


def test_a_watchdog_that_cannot_start_fails_up_loudly(gpuctl, ssh, monkeypatch):
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/nonexistent/python3")
    res = up_ssh(gpuctl, ssh, code=7)
    assert "the watchdog on root@" in res.stderr and "did not start" in res.stderr
    assert "No such file" in res.stderr or "not found" in res.stderr  # what the watchdog printed


def test_train_budget_is_the_runs_own_and_is_forgotten_with_it(gpuctl, make_project, isolated):
    """At $3600/h the cluster's uptime passes $2 within seconds; `--budget 2` used to kill the run
    with 0 epochs (it set the cluster's uptime budget). It must train epochs until that run's own
    epochs reach $2, and the next run has no budget."""
    gpuctl("up", "--usd-per-hour", "3600", "-y")
    time.sleep(2.5)  # the cluster's uptime is past $2 before the run starts
    proj = make_project("budget", {"train.py": MODEL + "\nmodel.fit(x, y, epochs=300, verbose=0)\n"})
    gpuctl("train", proj, "--budget", "2", "--wait")
    first = json.loads(gpuctl("cost", "--json").stdout)["runs"][-1]
    assert first["state"] == "succeeded" and 2 <= first["epochs_done"] < 300
    # The payload stops before an epoch that would pass the budget; only the first epoch (graph
    # tracing) cannot be foreseen.
    assert first["spent_usd"] - first["epochs"][-1]["epoch_cost_usd"] <= 2.0
    assert "budget of $2.0000 reached" in gpuctl("logs", first["run_id"]).stdout
    guard = json.loads(gpuctl("guard", "show", "--json").stdout)
    assert guard["config"]["budget_usd"] == 0  # the cluster's uptime budget was never set
    proj2 = make_project("nobudget", {"train.py": MODEL + "\nmodel.fit(x, y, epochs=3, verbose=0)\n"})
    gpuctl("train", proj2, "--wait")
    second = json.loads(gpuctl("cost", "--json").stdout)["runs"][-1]
    assert second["state"] == "succeeded" and second["epochs_done"] == 3


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
        assert train.returncode == 4 and "released while this train waited" in err, err
        assert runs == []
    time.sleep(1)
    assert subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True).returncode == 1


def test_idle_time_left_on_a_host_by_an_earlier_cluster_never_counts(gpuctl, ssh, monkeypatch):
    """A new `up` on a host used before fired at once: the watchdog restored `idle_since` from an
    old state.json. Here the old file says this boot and cluster number 1 (a fresh gpuctl home
    numbers its clusters from 1 again): idle still counts from this cluster's start only."""
    host = ssh.hosts[0]
    boot = host.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    old = {"idle_since": time.time() - 1000, "boot_id": boot, "cluster_key": "1-an-earlier-up",
           "at": time.time() - 900}
    host.run(f"mkdir -p /srv/gpuctl/guard && echo '{json.dumps(old)}' > /srv/gpuctl/guard/state.json")
    for key, value in {"CHECK_INTERVAL": "1s", "IDLE": "8s", "ON_FIRE": "poweroff",
                       "POWEROFF_COMMAND": f"date +%s >> {MARK}"}.items():
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    t0 = time.time()
    up_ssh(gpuctl, ssh)
    time.sleep(3)
    assert fired(host) is None and marks(host) == []  # the old file would have fired on the first look
    state = json.loads(gpuctl("guard", "show", "--json").stdout)["state"]
    assert state["idle_since"] >= t0 - 2 and state["boot_id"] == boot
