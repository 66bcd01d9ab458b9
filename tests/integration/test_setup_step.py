"""The setup step on a real sshd host: a real `pip install` of tensorflow-cpu (what a host without
a GPU gets; a GPU instance gets tensorflow[and-cuda]) into a fresh venv, from a local wheelhouse
built once from this checkout's own TensorFlow (scripts/wheelhouse.py: the test hosts have no
network), then preflight and a real TF run with that venv.

Bad inputs tried: a TensorFlow version no wheel exists for (fails at once, no retries, names the
version; the half-made venv is removed), `--tf` that is no version (refused before anything
runs), `logs --setup` where nothing was set up, and `--guard` with `--setup`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_ssh import TF_TRAIN, up_ssh

pytestmark = pytest.mark.tf


@pytest.fixture
def bare_host(ssh, wheels, monkeypatch):
    """The first lab host with no remote.python (gpuctl must find or make TensorFlow there), a work
    dir on a disk big enough for a TensorFlow venv (/srv is a small tmpfs), and the wheelhouse."""
    host = ssh.hosts[0]
    work = host.base / "work"
    monkeypatch.delenv("GPUCTL_REMOTE__PYTHON")
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(work))
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(wheels))
    yield host, work
    host.run(f"pkill -f 'gpuctl_[s]etup.py'; rm -rf {work}")  # [s]: not this shell's own command line


def test_up_installs_the_pinned_tf_then_train_uses_it(gpuctl, ssh, bare_host, make_project):
    host, work = bare_host
    env = work / "_envs" / "tf-2.21"
    out = up_ssh(gpuctl, ssh).stderr
    assert "no TensorFlow 2.21 there" in out and "installing tensorflow-cpu (no GPU seen) 2.21" in out
    assert "pip install tensorflow-cpu==2.21.* tensorboard (attempt 1 of 3)" in out and "ready: TensorFlow 2.21." in out
    marker = json.loads((env / ".gpuctl-ready").read_text())
    assert marker["tensorflow"].startswith("2.21.") and marker["variant"] == "cpu" and marker["wheelhouse"]
    # A venv of its own, not the test environment's Python.
    assert (env / "bin" / "python").exists() and (env / "pyvenv.cfg").exists()
    installed = {p.name.split("-")[0] for p in (env / "lib").glob("python3*/site-packages/*.dist-info")}
    assert {"tensorflow_cpu", "tf_keras", "tensorboard"} <= installed and "tensorflow" not in installed

    proj = make_project("setup", {"train.py": TF_TRAIN})
    res = gpuctl("train", proj, "--allow-cpu", "--wait", "--", "--epochs", "1")
    assert f"gpuctl's env {env} (ready)" in res.stderr
    assert "installing" not in res.stderr  # made once
    assert f"Python {marker['python']}" in res.stderr  # preflight ran with the venv's Python
    run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run["state"] == "succeeded" and run["tensorflow"] == marker["tensorflow"]

    log = gpuctl("logs", "--setup").stdout
    assert "Successfully installed" in log and "tensorflow_cpu" in log.replace("-", "_")

    # The env outlives the cluster: the next cluster on this host finds it ready.
    gpuctl("down", "-y")
    assert (env / ".gpuctl-ready").exists()
    again = up_ssh(gpuctl, ssh).stderr
    assert "(ready)" in again and "installing" not in again
    gpuctl("down", "-y")


def test_a_version_without_wheels_fails_at_once_and_leaves_no_half_venv(gpuctl, ssh, bare_host):
    host, work = bare_host
    res = up_ssh(gpuctl, ssh, extra=("--tf", "2.99"), code=7)
    err = res.stderr
    assert "the setup step failed on root@" in err and "pip found no tensorflow-cpu==2.99.*" in err
    assert "attempt 2" not in err  # not a flaky download: no retry
    assert "Hint:" in err and "logs --setup" in err
    assert not (work / "_envs" / "tf-2.99").exists()
    assert "No matching distribution" in gpuctl("logs", "--setup", "--tf", "2.99").stdout
    gpuctl("down", "-y")


def test_bad_setup_inputs(gpuctl, ssh, bare_host):
    host, work = bare_host
    res = up_ssh(gpuctl, ssh, extra=("--tf", "2.x"), code=3)
    assert "train.tensorflow" in res.stderr and json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    up_ssh(gpuctl, ssh, extra=("--tf", "2.99"), code=7)
    res = gpuctl("logs", "--setup", "--tf", "../../etc", code=3)
    assert "is not a TensorFlow version" in res.stderr
    res = gpuctl("logs", "--setup", "--tf", "2.20", code=7)
    assert "no setup log for TensorFlow 2.20" in res.stderr
    res = gpuctl("logs", "--setup", "--guard", code=2)
    assert "two different logs" in res.stderr
    gpuctl("down", "-y")


def test_a_laptop_that_closes_mid_install_leaves_an_install_that_finishes(gpuctl, ssh, bare_host, make_project):
    """`up` killed while pip runs (the laptop closed): the install goes on by itself on the host,
    and the next `train` waits for it or finds it ready, without a second install."""
    host, work = bare_host
    env = work / "_envs" / "tf-2.21"
    argv = [sys.executable, "-m", "gpuctl", "up", "--provider", "ssh", "--name", "box", "--identity", str(ssh.key),
            "--host", host.address]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        seen.append(line.strip())
        if "pip install tensorflow-cpu" in line or time.monotonic() > deadline:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(30)
    assert any("pip install tensorflow-cpu" in s for s in seen), seen
    assert not (env / ".gpuctl-ready").exists()  # killed mid-install
    # The install was not this command's child: it goes on without it.
    assert host.run("pgrep -f 'gpuctl_[s]etup.py install'").returncode == 0
    proj = make_project("after", {"train.py": TF_TRAIN})
    res = gpuctl("train", proj, "--allow-cpu", "--wait", "--", "--epochs", "1")
    assert (env / ".gpuctl-ready").exists()
    # Either it found the env ready, or it waited for the running install and then found it ready:
    # never a second pip run.
    log = (work / "_envs" / "tf-2.21.log").read_text()
    assert log.count("gpuctl-setup: pip install tensorflow-cpu") == 1, log[-2000:]
    assert "accuracy" in res.stdout
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"
    gpuctl("down", "-y")


def test_two_installs_at_once_each_get_their_own_result(wheels, tmp_path):
    """Two commands installing the same version at once (two clusters on one host): the second
    waits for the first's lock, then finds the env ready; each reads its own result file (one file
    for both let the later overwrite the earlier before its caller looked)."""
    payload = Path(__file__).resolve().parents[2] / "gpuctl" / "payloads" / "gpuctl_setup.py"
    root = tmp_path / "host"
    argv = ["python3", str(payload), "install", "--root", str(root), "--tensorflow", "2.21", "--wheelhouse", str(wheels)]
    first = subprocess.Popen(argv)
    time.sleep(1)
    second = subprocess.Popen(argv)
    assert first.wait(300) == 0 and second.wait(300) == 0
    results = {json.loads(p.read_text())["pid"]: json.loads(p.read_text())
               for p in (root / "_envs").glob("tf-2.21.result.*.json")}
    assert set(results) == {first.pid, second.pid}
    assert results[first.pid]["ok"] and not results[first.pid].get("skipped")
    assert results[second.pid]["ok"] and results[second.pid]["skipped"]
    log = (root / "_envs" / "tf-2.21.log").read_text()
    assert log.count("gpuctl-setup: pip install tensorflow-cpu") == 1


def test_local_says_when_its_tensorflow_is_not_the_asked_one(gpuctl, quick_project):
    """The local provider installs nothing: a --tf it does not have is said, not silently ignored;
    runs record the TensorFlow they had."""
    import importlib.metadata as md

    have = md.version("tensorflow-cpu")
    res = gpuctl("up", "--provider", "local", "--tf", "2.20", "-y")
    assert f"which has TensorFlow {have}, not 2.20: gpuctl installs nothing here" in res.stderr
    gpuctl("down", "-y")
    res = gpuctl("up", "--provider", "local", "-y")
    assert "warning" not in res.stderr
    gpuctl("train", quick_project, "--wait", "--", "--epochs", "1")
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["tensorflow"] == have
    gpuctl("down", "-y")
