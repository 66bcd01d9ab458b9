"""Several clusters on one ssh host, on a real sshd test host: each `up` works
in its own directory (`remote.workdir`/CLUSTER) with its own tmux server and watchdog; `down` of
one ends every process of its server (a job's daemon that ignores SIGHUP and SIGTERM and left the
job's session, TensorBoard, the watchdog) and nothing of the other's, and says so only once `ps`
shows none left.

Before: every ssh cluster on a host used ~/gpuctl and the tmux socket "gpuctl"; `down B` killed
A's server and watchdog while A's job (which ignores HUP) ran on, and A's status still promised
"idle in 27m". Bad cases tried: a daemon that ignores HUP and TERM, a second cluster of the same
name from another gpuctl home while the first still runs (refused), and a watchdog killed behind
gpuctl's back (status says no watchdog runs; `guard set` re-arms it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.integration.test_guards import GPUCTL, wait_for
from tests.integration.test_ssh import up_ssh
from tests.sshd import WORKDIR, gpuctl_servers, gpuctl_tmux

# A job that starts a daemon of its own: out of the job's process group and session, deaf to
# the hangup of a dying tmux server and to SIGTERM. Only SIGKILL ends it.
DAEMON_JOB = """
import subprocess, sys
tag = sys.argv[sys.argv.index("--tag") + 1]
subprocess.Popen(["sh", "-c", "trap '' HUP TERM; exec sleep " + tag + "2"], start_new_session=True)
print("started", flush=True)
subprocess.run(["sleep", tag + "1"])
"""


def processes(host) -> str:
    return host.run("ps -ww -eo pid,args").stdout  # -ww: whole command lines


def test_two_clusters_on_one_host_and_down_of_one_leaves_nothing_of_it(gpuctl, ssh, make_project, monkeypatch):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "1s")
    up_ssh(gpuctl, ssh, name="a")
    up_ssh(gpuctl, ssh, name="b")  # refused before: one host, one cluster
    proj = make_project("daemons", {"train.py": DAEMON_JOB})
    for name, tag in (("a", "1000"), ("b", "2000")):
        gpuctl("train", proj, "--cluster", name, "--allow-cpu", "--", "--tag", tag)
    wait_for(lambda: all(f"sleep {t}" in processes(host) for t in ("10001", "10002", "20001", "20002")))
    # TensorBoard on cluster a, left running after its forwarding ends (as after Ctrl-C).
    tb = subprocess.Popen([*GPUCTL, "tensorboard", "--cluster", "a", "--port", "16123"], env=dict(os.environ),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: f"gpuctl_tensorboard.py {WORKDIR}/a/runs" in processes(host), timeout=60)
    finally:
        os.killpg(tb.pid, signal.SIGTERM)
        tb.wait()
    a_tmux, b_tmux = gpuctl_tmux(host, f"{WORKDIR}/a"), gpuctl_tmux(host, f"{WORKDIR}/b")
    assert a_tmux != b_tmux
    b_watchdog = json.loads(host.run(f"cat {WORKDIR}/b/guard/state.json").stdout)["pid"]

    res = gpuctl("down", "a", "-y")
    assert "no process of the cluster is left" in res.stderr
    ps = processes(host)
    assert "sleep 10001" not in ps and "sleep 10002" not in ps, ps  # the job and its HUP/TERM-deaf daemon
    assert f"{WORKDIR}/a/runs" not in ps and f"{WORKDIR}/a/guard" not in ps, ps  # TensorBoard, a's watchdog
    assert a_tmux.split()[-1] not in gpuctl_servers(host)
    # b: its job, its daemon, its server and its watchdog, untouched; its status says so.
    assert "sleep 20001" in ps and "sleep 20002" in ps
    assert gpuctl_servers(host) == [b_tmux.split()[-1]]
    assert host.run(f"kill -0 {b_watchdog}").returncode == 0
    status = json.loads(gpuctl("status", "--json").stdout)
    assert [r["state"] for r in status["runs"] if r["cluster"] == "b"] == ["running"]
    at = json.loads(host.run(f"cat {WORKDIR}/b/guard/state.json").stdout)["at"]
    wait_for(lambda: json.loads(host.run(f"cat {WORKDIR}/b/guard/state.json").stdout)["at"] > at, timeout=10)
    text = gpuctl("status").stdout
    assert f"b: watchdog pid {b_watchdog}, last look" in text

    gpuctl("down", "b", "-y")
    ps = processes(host)
    assert "sleep 20001" not in ps and "sleep 20002" not in ps and gpuctl_servers(host) == []


def test_the_same_name_from_another_home_is_refused_while_the_first_runs(gpuctl, ssh, monkeypatch, tmp_path):
    up_ssh(gpuctl, ssh)
    first = os.environ["GPUCTL_HOME"]
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path / "a second laptop"))
    res = up_ssh(gpuctl, ssh, code=5)
    assert f"{WORKDIR}/box on root@" in res.stderr and "in use by another live gpuctl cluster named 'box'" in res.stderr
    assert "Pick another --name" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []  # nothing recorded there
    up_ssh(gpuctl, ssh, name="box2")  # another name is fine
    gpuctl("down", "-y")
    monkeypatch.setenv("GPUCTL_HOME", first)
    gpuctl("down", "-y")


def test_status_says_when_no_watchdog_runs_and_guard_set_rearms_it(gpuctl, ssh, monkeypatch):
    host = ssh.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "1s")
    up_ssh(gpuctl, ssh)
    tmux = gpuctl_tmux(host)
    pid = json.loads(host.run("cat /srv/gpuctl/box/guard/state.json").stdout)["pid"]
    host.run(f"{tmux} kill-session -t =gpuctl-watchdog; kill {pid}")  # cron would revive it; no cron here
    def says_none_runs() -> str | None:
        out = gpuctl("status").stdout
        return out if "NO WATCHDOG RUNS" in out else None

    text = wait_for(says_none_runs, timeout=30)
    assert "gpuctl guard set --cluster box" in text, text
    gpuctl("guard", "set")
    text = gpuctl("status").stdout
    assert "NO WATCHDOG RUNS" not in text and "box: watchdog pid" in text, text


@pytest.mark.slow  # a job deaf to SIGTERM: down waits out its grace periods (~20 s)
def test_down_of_a_local_cluster_ends_what_its_jobs_left_behind(gpuctl, make_project, isolated):
    """The local provider too: a job's HUP/TERM-deaf daemon outlived `tmux kill-server` before."""
    gpuctl("up", "--provider", "local")
    proj = make_project("daemons", {"train.py": DAEMON_JOB})
    gpuctl("train", proj, "--", "--tag", "3000")
    mine = lambda: subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout  # noqa: E731
    wait_for(lambda: "sleep 30001" in mine() and "sleep 30002" in mine())
    res = gpuctl("down", "-y")
    assert "Traceback" not in res.stderr
    assert "sleep 30001" not in mine() and "sleep 30002" not in mine()
