"""Every job starts from a clean environment: what gpuctl sets and what `--env` names, nothing of
the environment of the `gpuctl` that started the cluster's tmux server or of the one that submits
the run (AWS keys, the ssh agent), nor what sshd gives its sessions. Local provider and a real
sshd test host; real tmux.

Bad inputs tried: AWS_SECRET_ACCESS_KEY and SSH_AUTH_SOCK set for `up` and for `train` (not named
by --env); a tmux server for the cluster started by hand with a dirty environment (as an older
gpuctl left it) before `train`."""

from __future__ import annotations

import json

from tests.conftest import QUICK_TRAIN
from tests.integration.test_ssh import up_ssh

SHOW_ENV = QUICK_TRAIN + """
import os
print("ENV " + json.dumps(dict(os.environ)), flush=True)
""".replace("import os\n", "import json, os\n")


def _job_env(gpuctl, proj, *extra) -> dict:
    run = json.loads(gpuctl("train", str(proj), "--allow-cpu", "--wait", "--json", *extra).stdout)["run"]
    assert run["state"] == "succeeded", run
    log = gpuctl("logs", run["run_id"]).stdout
    return json.loads(next(line for line in log.splitlines() if line.startswith("ENV "))[4:])


def _dirty(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak")
    monkeypatch.setenv("SSH_AUTH_SOCK", "/tmp/leak-agent.sock")
    monkeypatch.setenv("NAMED_TOKEN", "passed")


def _check(env: dict) -> None:
    assert "leak" not in json.dumps(env), env
    assert "AWS_SECRET_ACCESS_KEY" not in env and "SSH_AUTH_SOCK" not in env
    assert env.get("NAMED_TOKEN") == "passed"  # named by --env
    assert env["GPUCTL_RUN_ID"] and env["PATH"] and env["HOME"]  # gpuctl's own, and the basics kept


def test_a_local_job_sees_only_what_gpuctl_sets_and_env_names(gpuctl, make_project, monkeypatch):
    _dirty(monkeypatch)
    gpuctl("up", "--provider", "local")  # starts the cluster's tmux server (the watchdog's session)
    proj = make_project("p", {"train.py": SHOW_ENV})
    _check(_job_env(gpuctl, proj, "--env", "NAMED_TOKEN"))
    gpuctl("down", "-y")


def test_a_dirty_tmux_server_does_not_reach_the_job(gpuctl, make_project, monkeypatch, isolated):
    """A server an older gpuctl started with its caller's environment: the job script itself
    starts the job from a clean one."""
    import subprocess

    from gpuctl.remote.local import LocalHost
    from gpuctl.remote.tmux import argv

    gpuctl("up", "--provider", "local")
    host = LocalHost(isolated / "clusters" / "default")
    subprocess.run(argv(host, "kill-server"), capture_output=True)
    _dirty(monkeypatch)
    import os

    subprocess.run(argv(host, "new-session", "-d", "-s", "old", "sleep 60"), check=True, env=dict(os.environ))
    proj = make_project("p", {"train.py": SHOW_ENV})
    _check(_job_env(gpuctl, proj, "--env", "NAMED_TOKEN"))
    gpuctl("down", "-y")


def test_a_job_over_ssh_sees_only_what_gpuctl_sets_and_env_names(gpuctl, ssh, make_project, monkeypatch):
    _dirty(monkeypatch)
    up_ssh(gpuctl, ssh)
    proj = make_project("p", {"train.py": SHOW_ENV})
    env = _job_env(gpuctl, proj, "--env", "NAMED_TOKEN")
    _check(env)
    assert not [k for k in env if k.startswith("SSH_")], env  # sshd's own session variables
    gpuctl("down", "-y")
