"""A run is what was submitted (issue 37): its own code, fixed when `train` queued or started it,
and its data by identity (where it comes from), never by folder name. On the local provider with
real tmux, and on an sshd test host.

The job scripts are plain Python that wait on barrier files (no TensorFlow): a run prints its code
version, then waits until `go` exists in a shared folder.

Bad inputs tried: two data folders both named `data` pushed one after the other (each kept whole);
a data file deleted and the data pushed again while a run of it waits (the run still reads it);
the project edited between two queued runs; a project whose HEAD is a loose ref, then a packed one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT
from tests.waits import wait_for

VERSIONED = '''
import os, sys, time
VERSION = "v1"
gate = sys.argv[1]
print("code", VERSION, flush=True)
data = os.environ.get("GPUCTL_DATA_DIR")
if data:
    print("data", sorted(os.listdir(data)), flush=True)
if sys.argv[2:] == ["block"]:
    os.makedirs(gate, exist_ok=True)
    open(os.path.join(gate, "started"), "w").close()
    while not os.path.exists(os.path.join(gate, "go")):
        time.sleep(0.05)
print("done", flush=True)
'''


def runs(gpuctl) -> list[dict]:
    return json.loads(gpuctl("status", "--json").stdout)["runs"]


def log_of(gpuctl, run_id: str) -> str:
    return gpuctl("logs", run_id, "-f").stdout


def git(project: Path, *args: str) -> str:
    """The test's own git (never gpuctl's: it reads a checkout as files)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(project), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True, text=True).stdout


def test_a_queued_run_keeps_the_code_it_was_submitted_with(gpuctl, make_project, tmp_path):
    proj, gate = make_project("versioned", {"train.py": VERSIONED}), tmp_path / "gate"
    git(proj, "init", "-q")
    git(proj, "add", "train.py")
    git(proj, "commit", "-qm", "v1")
    v1_commit = git(proj, "rev-parse", "HEAD").strip()
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", gate, "block")
    wait_for(lambda: (gate / "started").exists(), what="run 1 started")
    assert "queued on" in gpuctl("train", proj, "--", gate).stdout
    (proj / "train.py").write_text(VERSIONED.replace('"v1"', '"v2"'))
    git(proj, "commit", "-qam", "v2")
    git(proj, "pack-refs", "--all")  # HEAD's branch now only in packed-refs
    v2_commit = git(proj, "rev-parse", "HEAD").strip()
    (proj / "notes.py").write_text("# pushed, never committed\n")
    assert "queued on" in gpuctl("train", proj, "--", gate).stdout
    first, second, third = runs(gpuctl)  # in the order they were submitted
    (gate / "go").touch()
    assert "code v1" in log_of(gpuctl, second["run_id"])
    assert "code v2" in log_of(gpuctl, third["run_id"])
    # `status RUN` says which code each ran: its content hash, and the commit of its checkout.
    shown = {r["run_id"]: r["code"] for r in runs(gpuctl)}
    assert shown[first["run_id"]] == shown[second["run_id"]] == {"hash": shown[first["run_id"]]["hash"],
                                                                  "commit": v1_commit, "dirty": False}
    assert shown[third["run_id"]]["commit"] == v2_commit and shown[third["run_id"]]["dirty"] is True and shown[third["run_id"]]["hash"] != shown[first["run_id"]]["hash"]
    one = gpuctl("status", second["run_id"]).stdout
    assert f"code {shown[second['run_id']]['hash']} (git {v1_commit[:12]})" in one
    assert f"(git {v2_commit[:12]}, dirty)" in gpuctl("status", third["run_id"]).stdout


def test_a_resume_takes_the_code_as_it_is_then(gpuctl, make_project, tmp_path):
    # A run that fails after its first "epoch", leaving a checkpoint as a Keras fit would.
    fails = VERSIONED.replace('print("done"', 'ckpt = os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "checkpoint")\n'
                              'os.makedirs(ckpt, exist_ok=True)\nopen(os.path.join(ckpt, "chief"), "w").close()\n'
                              'sys.exit(3)\nprint("done"')
    proj, gate = make_project("resumed", {"train.py": fails}), tmp_path / "g"
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", gate)
    (run,) = runs(gpuctl)
    assert "code v1" in gpuctl("logs", run["run_id"], "-f").stdout
    (proj / "train.py").write_text(fails.replace('"v1"', '"v2"'))
    gpuctl("train", "--resume", run["run_id"])
    assert "code v2" in log_of(gpuctl, run["run_id"])
    assert runs(gpuctl)[0]["code"]["hash"] != run["code"]["hash"]


def test_two_data_folders_named_data_keep_their_files_and_a_waiting_run_keeps_its_data(gpuctl, make_project, tmp_path):
    proj, gate = make_project("reader", {"train.py": VERSIONED}), tmp_path / "gate"
    mine, theirs = tmp_path / "mine" / "data", tmp_path / "theirs" / "data"
    for d, names in ((mine, ("a.bin", "b.bin")), (theirs, ("x.bin",))):
        d.mkdir(parents=True)
        for n in names:
            (d / n).write_bytes(b"\1" * 100)
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    first = json.loads(gpuctl("sync", proj, "--data", mine, "--json").stdout)
    second = json.loads(gpuctl("sync", proj, "--data", theirs, "--json").stdout)
    assert second["data"]["files_deleted"] == 0 and first["data_dir"] != second["data_dir"]
    assert sorted(os.listdir(first["data_dir"])) == ["a.bin", "b.bin"]
    assert sorted(os.listdir(second["data_dir"])) == ["x.bin"]
    assert json.loads(gpuctl("sync", proj, "--data", mine, "--json").stdout)["data"]["files_copied"] == 0
    # A run of `mine` waits its turn; meanwhile a file of it is deleted here and the data pushed again.
    gpuctl("train", proj, "--", gate, "block")
    wait_for(lambda: (gate / "started").exists(), what="the first run started")
    gpuctl("train", proj, "--data", mine, "--", gate)
    (mine / "b.bin").unlink()
    assert json.loads(gpuctl("sync", proj, "--data", mine, "--json").stdout)["data"]["files_deleted"] == 1
    (gate / "go").touch()
    waiting = runs(gpuctl)[-1]
    assert "data ['a.bin', 'b.bin']" in log_of(gpuctl, waiting["run_id"])


def test_a_run_copy_costs_links_not_bytes(gpuctl, make_project, tmp_path):
    proj = make_project("linked", {"train.py": VERSIONED, "lib/model.py": "W = 1\n"})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--", tmp_path / "g").stdout
    (run,) = runs(gpuctl)
    log_of(gpuctl, run["run_id"])
    again = json.loads(gpuctl("sync", proj, "--json").stdout)
    assert again["code"]["files_copied"] == 0 and again["code"]["files_deleted"] == 0, out
    staging = Path(again["code_dir"])
    own = staging.parent.parent / "runs" / run["run_id"] / "code"
    for rel in ("train.py", "lib/model.py"):
        assert (staging / rel).stat().st_ino == (own / rel).stat().st_ino
    # `runs rm` takes the run's copy with it; the pushed tree stays for the next push.
    gpuctl("runs", "rm", run["run_id"], "-y")
    assert not own.exists() and (staging / "train.py").is_file()


def test_on_an_ssh_host_same_named_data_folders_stay_apart_and_runs_link_their_code(gpuctl, ssh, make_project, tmp_path):
    host = ssh.hosts[0]
    proj = make_project("remote", {"train.py": VERSIONED})
    mine, theirs = tmp_path / "mine" / "data", tmp_path / "theirs" / "data"
    for d, name in ((mine, "a.bin"), (theirs, "x.bin")):
        d.mkdir(parents=True)
        (d / name).write_bytes(os.urandom(1000))
    up_ssh(gpuctl, ssh)
    first = json.loads(gpuctl("sync", proj, "--data", mine, "--json").stdout)
    second = json.loads(gpuctl("sync", proj, "--data", theirs, "--json").stdout)
    assert second["data"]["files_deleted"] == 0
    assert host.run(f"ls {first['data_dir']}").stdout.split() == ["a.bin"]
    assert host.run(f"ls {second['data_dir']}").stdout.split() == ["x.bin"]
    gpuctl("train", proj, "--data", mine, "--allow-cpu", "--", tmp_path / "g")
    (run,) = runs(gpuctl)
    assert "code v1" in log_of(gpuctl, run["run_id"])
    run_dir = f"{ROOT}/runs/{run['run_id']}"
    inodes = host.run(f"stat -c %i {first['code_dir']}/train.py {run_dir}/code/train.py "
                      f"{first['data_dir']}/a.bin {run_dir}/data/a.bin").stdout.split()
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3]
    # An edit replaces the pushed file (a new inode): the run's copy keeps what it ran.
    (proj / "train.py").write_text(VERSIONED.replace('"v1"', '"v2"'))
    assert json.loads(gpuctl("sync", proj, "--json").stdout)["code"]["files_copied"] == 1
    assert 'VERSION = "v1"' in host.run(f"cat {run_dir}/code/train.py").stdout
    assert 'VERSION = "v2"' in host.run(f"cat {first['code_dir']}/train.py").stdout


def test_a_released_local_cluster_keeps_a_run_without_its_copies(gpuctl, make_project, tmp_path, isolated):
    proj = make_project("kept", {"train.py": VERSIONED})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--", tmp_path / "g")
    (run,) = runs(gpuctl)
    log_of(gpuctl, run["run_id"])
    gpuctl("down", "-y")
    kept = isolated / "runs" / run["run_id"]
    assert (kept / "output.log").is_file() and not (kept / "code").exists()
