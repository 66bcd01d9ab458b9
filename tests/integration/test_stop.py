"""`gpuctl stop [RUN]` on the real local provider (real tmux, plain-Python jobs), and Ctrl-C in the
commands that follow a run (`train --wait`, `logs -f`, `watch`): they detach, the run goes on.

Bad inputs tried: an unknown run (exit 4), a run that already ended (exit 0, says so), a run on a
released cluster (exit 4), RUN with --all (usage), RUN with a --cluster it is not on (exit 5), and
`stop` with nothing running (exit 0, says so)."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.test_guards import wait_for

GPUCTL = [str(REPO / ".venv" / "bin" / "gpuctl")]

# Writes its pid and, once, a "checkpoint" (a file of its own under outputs/checkpoint) and then
# runs until stopped; started again on that checkpoint (train --resume), it says so and ends.
LONG = '''
import os, time
run_dir = os.environ["GPUCTL_RUN_DIR"]
ckpt = os.path.join(run_dir, "outputs", "checkpoint")
os.makedirs(ckpt, exist_ok=True)
mark = os.path.join(ckpt, "progress")
if os.path.exists(mark):
    print("resumed from", open(mark).read(), flush=True)
    raise SystemExit(0)
with open(os.path.join(run_dir, "pid"), "w") as fh:
    fh.write(str(os.getpid()))
with open(mark, "w") as fh:
    fh.write("epoch 1")
print("tick", flush=True)
while True:
    time.sleep(0.2)
'''


def _run(gpuctl, run_id):
    return next(r for r in json.loads(gpuctl("status", "--json").stdout)["runs"] if r["run_id"] == run_id)


def _started(gpuctl, proj) -> tuple[str, int]:
    """A LONG run, once its script runs: its id and its process id (--now: beside the runs
    already there, not queued behind them)."""
    run = json.loads(gpuctl("train", proj, "--now", "--json").stdout)["run"]
    pid_file = Path(run["run_dir"]) / "pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout=60)
    return run["run_id"], int(pid_file.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def long_project(make_project):
    return make_project("long", {"train.py": LONG})


def test_stop_ends_the_latest_run_and_keeps_the_cluster(gpuctl, long_project, quick_project):
    gpuctl("up")
    first, _ = _started(gpuctl, long_project)
    run_id, pid = _started(gpuctl, long_project)
    out = gpuctl("stop").stdout
    assert f"Stopped run {run_id} on cluster 'default' (SIGTERM, then SIGKILL after 10 s" in out
    assert f"gpuctl train --resume {run_id}" in out and "stays up" in out
    assert _run(gpuctl, run_id)["state"] == "stopped" and not _alive(pid)
    assert _run(gpuctl, first)["state"] == "running"  # only the latest
    status = json.loads(gpuctl("status", "--json").stdout)
    assert [c["name"] for c in status["clusters"]] == ["default"]
    assert "done" in gpuctl("train", quick_project, "--now", "--wait").stdout  # the cluster still trains

    # Named, as JSON.
    res = json.loads(gpuctl("stop", first, "--json").stdout)
    assert res["cluster"] == "default" and res["grace_s"] == 10
    assert [r["run_id"] for r in res["stopped"]] == [first] and res["stopped"][0]["state"] == "stopped"
    assert res["already_ended"] is None

    # Already ended: exit 0, said so.
    assert f"Run {run_id} already ended (stopped); nothing to stop." in gpuctl("stop", run_id).stdout
    ended = json.loads(gpuctl("stop", run_id, "--json").stdout)
    assert ended["stopped"] == [] and ended["already_ended"]["run_id"] == run_id
    assert "No run is running on cluster 'default'; nothing to stop." in gpuctl("stop").stdout


def test_stop_all_ends_every_running_run_of_the_cluster(gpuctl, long_project):
    gpuctl("up", "--name", "other")
    gpuctl("up")  # the default now
    (a, pa), (b, pb) = _started(gpuctl, long_project), _started(gpuctl, long_project)
    other = json.loads(gpuctl("train", long_project, "--cluster", "other", "--json").stdout)["run"]["run_id"]
    res = json.loads(gpuctl("stop", "--all", "--cluster", "default", "--json").stdout)
    assert sorted(r["run_id"] for r in res["stopped"]) == sorted([a, b])
    assert _run(gpuctl, a)["state"] == _run(gpuctl, b)["state"] == "stopped"
    assert not _alive(pa) and not _alive(pb)
    assert _run(gpuctl, other)["state"] == "running"  # another cluster's run is not touched
    assert "is on cluster 'other', not 'default'" in gpuctl("stop", other, "--cluster", "default", code=5).stderr
    gpuctl("stop", "--cluster", "other")
    assert _run(gpuctl, other)["state"] == "stopped"


def test_stop_refuses_unknown_runs_and_released_clusters(gpuctl, long_project):
    res = gpuctl("stop", "nope-1", code=4)
    assert "Error: no run named 'nope-1'" in res.stderr and "Hint:" in res.stderr
    assert "RUN names one run" in gpuctl("stop", "x", "--all", code=2).stderr
    gpuctl("up")
    run_id, _ = _started(gpuctl, long_project)
    gpuctl("down", "-y")
    res = gpuctl("stop", run_id, code=4)
    assert "which is released" in res.stderr and f"gpuctl logs {run_id}" in res.stderr


def test_a_stopped_run_resumes_from_its_checkpoint(gpuctl, long_project):
    gpuctl("up")
    run_id, _ = _started(gpuctl, long_project)
    gpuctl("stop", run_id)
    assert _run(gpuctl, run_id)["resumable"]
    res = gpuctl("train", "--resume", run_id, "--wait")
    assert "resumed from epoch 1" in res.stdout
    assert _run(gpuctl, run_id)["state"] == "succeeded"


def _interrupted(argv: list[str], ready: str) -> subprocess.CompletedProcess:
    """Run gpuctl, send it SIGINT (a terminal's Ctrl-C) once `ready` is in its output."""
    # SIGINT as a terminal's shell leaves it: xdist's workers ignore SIGINT, and a Python started
    # with it ignored never turns Ctrl-C into KeyboardInterrupt (the test then waited 60 s).
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if ready in line:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, proc.returncode, "".join(seen) + rest)


@pytest.mark.parametrize("follow", ["train", "logs", "watch"])
def test_ctrl_c_while_following_detaches_and_the_run_goes_on(gpuctl, long_project, follow):
    gpuctl("up", "--usd-per-hour", "1.006", "-y")
    if follow == "train":
        res = _interrupted([*GPUCTL, "train", str(long_project), "--wait"], "tick")
        run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    else:
        run_id, _ = _started(gpuctl, long_project)
        argv = [*GPUCTL, "logs", "-f", run_id] if follow == "logs" else [*GPUCTL, "watch", run_id]
        res = _interrupted(argv, "tick" if follow == "logs" else "")
    assert res.returncode == 130, res.stdout
    assert (f"Detached: run {run_id} keeps running on cluster 'default' at $1.0060/h; "
            f"stop it with: gpuctl stop {run_id}") in res.stdout
    assert "Interrupted." not in res.stdout
    assert _run(gpuctl, run_id)["state"] == "running"
    gpuctl("stop", run_id)


def test_ctrl_c_while_following_a_queued_run_says_it_stays_queued(gpuctl, long_project):
    # It said the queued run "keeps running ... at $1.0060/h": it waits, and pays nothing yet.
    gpuctl("up", "--usd-per-hour", "1.006", "-y")
    first, _ = _started(gpuctl, long_project)
    queued = json.loads(gpuctl("train", long_project, "--json").stdout)["run"]["run_id"]
    assert _run(gpuctl, queued)["state"] == "queued"
    res = _interrupted([*GPUCTL, "logs", "-f", queued], "queued")
    assert res.returncode == 130, res.stdout
    assert (f"Detached: run {queued} stays queued on cluster 'default' and starts there when its GPUs "
            f"are free; take it out with: gpuctl stop {queued}") in res.stdout
    assert _run(gpuctl, queued)["state"] == "queued"
    gpuctl("stop", "--all")


def test_stop_ends_the_run_on_every_node(gpuctl, long_project, isolated):
    gpuctl("up", "--nodes", "2", "--usd-per-hour", "1.5", "-y")
    run = json.loads(gpuctl("train", long_project, "--allow-cpu", "--json").stdout)["run"]
    run_id = run["run_id"]
    pid_files = [Path(run["run_dir"]) / "pid", isolated / "clusters" / "default" / "nodes" / "1" / "runs" / run_id / "pid"]
    pids = [int(wait_for(lambda f=f: f.exists() and f.read_text(), timeout=60)) for f in pid_files]
    res = json.loads(gpuctl("stop", "--json").stdout)
    (stopped,) = res["stopped"]
    assert stopped["run_id"] == run_id and stopped["node_states"] == ["stopped", "stopped"]
    assert not any(_alive(p) for p in pids)
    assert _run(gpuctl, run_id)["state"] == "stopped"
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "up"
