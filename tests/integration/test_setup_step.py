"""The setup step on a real sshd host: one real `pip install` of tensorflow-cpu (what a host
without a GPU gets; a GPU instance gets tensorflow[and-cuda]) into a fresh venv, from a local
wheelhouse built once from this checkout's own TensorFlow (scripts/wheelhouse.py: the test hosts
have no network), then preflight and a real TF run with that venv. The install's mechanics (a
killed install that goes on, two installs sharing the lock, the half-made venv removed) install
the small stand-in wheels of tests/small_wheels.py instead: what they prove happens around pip.

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
from tests.waits import wait_for


@pytest.fixture
def bare_host(ssh, small_wheels, monkeypatch):
    """The first lab host with no remote.python (gpuctl must find or make TensorFlow there), a work
    dir on a disk big enough for a TensorFlow venv (/srv is a small tmpfs), and the small wheelhouse."""
    host = ssh.hosts[0]
    work = host.base / "work"
    # Bare from the start: another test on this host (a failed setup's) may have left its venvs
    # and install log there, and a test that counts the log's pip runs would count theirs too.
    host.run(f"rm -rf {work}")
    monkeypatch.delenv("GPUCTL_REMOTE__PYTHON")
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(work))
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(small_wheels))
    yield host, work
    (small_wheels / "HOLD").unlink(missing_ok=True)
    # Only this host's installs (--root WORK): the test hosts share this machine's processes, and
    # a plain pkill ended other xdist workers' installs ("ended without a result"). [s]: not this
    # shell's own command line.
    host.run(f"pkill -f 'gpuctl_[s]etup.py install --root {work} '; rm -rf {work}")


def test_up_installs_the_pinned_tf_then_train_uses_it(gpuctl, ssh, bare_host, wheels, make_project, monkeypatch):
    """The one real install: TensorFlow's own wheels, then a real Keras run with that venv."""
    host, work = bare_host
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(wheels))
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
    # 2.22 passes gpuctl's dated list (the minor release after it) and the wheelhouse has none.
    res = up_ssh(gpuctl, ssh, extra=("--tf", "2.22"), code=7)
    err = res.stderr
    assert "the setup step failed on root@" in err and "pip found no tensorflow-cpu==2.22.*" in err
    assert "attempt 2" not in err  # not a flaky download: no retry
    assert "Hint:" in err and "logs --setup" in err
    assert not (work / "_envs" / "tf-2.22").exists()
    assert "No matching distribution" in gpuctl("logs", "--setup", "--tf", "2.22").stdout
    gpuctl("down", "-y")


def test_a_host_without_network_is_said_so_with_the_settings_that_fix_it(gpuctl, ssh, bare_host, monkeypatch):
    # The error read "pip found no tensorflow-cpu==2.21.*" while pip's log showed
    # name-resolution failures. The test hosts have no network: without the wheelhouse pip asks PyPI.
    host, work = bare_host
    monkeypatch.delenv("GPUCTL_REMOTE__WHEELHOUSE")
    err = up_ssh(gpuctl, ssh, code=7).stderr
    assert "Error: no network to the package index from root@" in err and "tensorflow-cpu==2.21.*" in err
    assert "remote.wheelhouse" in err and "remote.python" in err and "pip found no" not in err
    gpuctl("down", "-y")


def test_a_failed_setup_stays_in_status_and_up_again_sets_up_with_todays_settings(gpuctl, ssh, monkeypatch,
                                                                                 quick_project):
    """The cluster of a failed setup stays (`down` releases it) and `status` says
    `setup failed: why`; `up` again set it up with today's settings (it said "already up" and kept
    the remote.python of its first `up`). The setup fails at once: a wheelhouse without TensorFlow
    (without one, pip finds no network here, the same failure after minutes of retries)."""
    host = ssh.hosts[0]
    python = os.environ["GPUCTL_REMOTE__PYTHON"]
    monkeypatch.delenv("GPUCTL_REMOTE__PYTHON")
    monkeypatch.setenv("GPUCTL_REMOTE__WORKDIR", str(host.base / "work"))  # room for a venv
    (host.base / "no-wheels").mkdir(exist_ok=True)
    monkeypatch.setenv("GPUCTL_REMOTE__WHEELHOUSE", str(host.base / "no-wheels"))
    err = up_ssh(gpuctl, ssh, code=7).stderr
    assert "Error: the setup step failed on root@" in err and "pip found no tensorflow-cpu==2.21.*" in err
    assert "`gpuctl up` again" in err
    cluster = json.loads(gpuctl("status", "--json").stdout)["clusters"][0]
    assert cluster["state"] == "up" and cluster["setup_failed"].startswith("the setup step failed on root@")
    assert "box: setup failed: the setup step failed on root@" in " ".join(gpuctl("status").stdout.split())
    # Machines other than the cluster's are still a conflict: a setup retry never moves a cluster.
    assert "is up with other settings" in up_ssh(gpuctl, ssh, ssh.hosts[0], ssh.hosts[1], code=5).stderr
    # A Python with TensorFlow set since: honoured, and the cluster is no longer shown as failed.
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", python)
    out = up_ssh(gpuctl, ssh)
    assert "setup failed (the setup step failed" in out.stderr and "setting it up again with today's" in out.stderr
    assert "was already up" in out.stdout and "Error" not in out.stderr
    cluster = json.loads(gpuctl("status", "--json").stdout)["clusters"][0]
    assert cluster["setup_failed"] is None and "setup failed" not in gpuctl("status").stdout
    res = gpuctl("train", quick_project, "--allow-cpu", "--wait")
    assert "done" in res.stdout
    # Its runs use that Python (the cluster's recorded spec changed, not just this command's).
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"
    assert up_ssh(gpuctl, ssh, code=5).stderr.startswith("Error: a cluster named 'box' is already up")
    gpuctl("down", "-y")
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"


def test_bad_setup_inputs(gpuctl, ssh, bare_host):
    host, work = bare_host
    res = up_ssh(gpuctl, ssh, extra=("--tf", "2.x"), code=3)
    assert "train.tensorflow" in res.stderr and json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    # Never a TensorFlow release: refused before the host is touched.
    res = up_ssh(gpuctl, ssh, extra=("--tf", "9.99"), code=3)
    assert "--tf 9.99: no such TensorFlow release" in res.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == [] and not (work / "_envs").exists()
    up_ssh(gpuctl, ssh, extra=("--tf", "2.22"), code=7)
    res = gpuctl("logs", "--setup", "--tf", "../../etc", code=3)
    assert "is not a TensorFlow version" in res.stderr
    res = gpuctl("logs", "--setup", "--tf", "2.20", code=7)
    assert "no setup log for TensorFlow 2.20" in res.stderr
    res = gpuctl("logs", "--setup", "--guard", code=2)
    assert "two different logs" in res.stderr
    gpuctl("down", "-y")


def test_a_laptop_that_closes_mid_install_leaves_an_install_that_finishes(gpuctl, ssh, bare_host, small_wheels,
                                                                          quick_project):
    """`up` killed while pip runs (the laptop closed): the install goes on by itself on the host,
    and the next `train` waits for it or finds it ready, without a second install."""
    host, work = bare_host
    env = work / "_envs" / "tf-2.21"
    hold = small_wheels / "HOLD"
    hold.touch()  # the install stops between its two pip runs until the file goes: mid-install, no race
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
    assert host.run(f"pgrep -f 'gpuctl_[s]etup.py install --root {work} '").returncode == 0
    hold.unlink()
    res = gpuctl("train", quick_project, "--allow-cpu", "--wait", "--", "--epochs", "1")
    assert (env / ".gpuctl-ready").exists()
    # Either it found the env ready, or it waited for the running install and then found it ready:
    # never a second pip run.
    log = (work / "_envs" / "tf-2.21.log").read_text()
    assert log.count("gpuctl-setup: pip install tensorflow-cpu") == 1, log[-2000:]
    assert "done" in res.stdout
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"
    gpuctl("down", "-y")


def test_two_installs_at_once_each_get_their_own_result(small_wheels, tmp_path):
    """Two commands installing the same version at once (two clusters on one host): the second
    waits for the first's lock, then finds the env ready; each reads its own result file (one file
    for both let the later overwrite the earlier before its caller looked)."""
    payload = Path(__file__).resolve().parents[2] / "gpuctl" / "payloads" / "gpuctl_setup.py"
    root = tmp_path / "host"
    log = root / "_envs" / "tf-2.21.log"
    argv = ["python3", str(payload), "install", "--root", str(root), "--tensorflow", "2.21", "--wheelhouse",
            str(small_wheels)]
    hold = small_wheels / "HOLD"
    hold.touch()  # the first install holds the lock, mid-install, until the second has started
    try:
        first = subprocess.Popen(argv)
        def at_pip() -> bool:
            if log.exists() and "pip install tensorflow-cpu" in log.read_text():
                return True
            assert first.poll() is None, "the first install ended before pip"
            return False

        wait_for(at_pip, 120, "the first install at pip")
        second = subprocess.Popen(argv)
    finally:
        hold.unlink()
    assert first.wait(300) == 0 and second.wait(300) == 0
    results = {json.loads(p.read_text())["pid"]: json.loads(p.read_text())
               for p in (root / "_envs").glob("tf-2.21.result.*.json")}
    assert set(results) == {first.pid, second.pid}
    assert results[first.pid]["ok"] and not results[first.pid].get("skipped")
    assert results[second.pid]["ok"] and results[second.pid]["skipped"]
    log = (root / "_envs" / "tf-2.21.log").read_text()
    assert log.count("gpuctl-setup: pip install tensorflow-cpu") == 1


@pytest.mark.slow  # real venvs and pip runs: 16 CPU-seconds
def test_an_install_that_waited_for_a_failed_one_fails_at_once_with_its_error(tmp_path):
    """Two nodes with one home (or two clusters on one host) set up one env: the second waited
    for the first's lock, and when the first failed it ran the same failing pip again (minutes of
    retries on a host without network, which a new user hit). Now it fails at
    once with the first one's error. Real venv and pip, offline: a wheelhouse without TensorFlow."""
    payload = Path(__file__).resolve().parents[2] / "gpuctl" / "payloads" / "gpuctl_setup.py"
    root, empty = tmp_path / "home", tmp_path / "no-wheels"
    empty.mkdir()
    argv = ["python3", str(payload), "install", "--root", str(root), "--tensorflow", "2.21", "--wheelhouse", str(empty)]
    first = subprocess.Popen(argv)
    log = root / "_envs" / "tf-2.21.log"
    wait_for(lambda: log.exists() and "setting up" in log.read_text(), 60, "the first install's lock")
    second = subprocess.Popen(argv)
    assert first.wait(300) == 1 and second.wait(300) == 1
    results = {json.loads(p.read_text())["pid"]: json.loads(p.read_text())
               for p in (root / "_envs").glob("tf-2.21.result.*.json")}
    assert results[first.pid]["error"].startswith("pip found no tensorflow-cpu==2.21.*")
    assert results[second.pid]["error"] == results[first.pid]["error"]
    text = log.read_text()
    assert text.count("gpuctl-setup: pip install tensorflow-cpu") == 1, text[-2000:]
    assert "not tried again: the install that held the lock failed a moment ago" in text
    # Later, nothing holding the lock: an install tries again (the host may have been fixed since).
    assert subprocess.run(argv).returncode == 1
    assert log.read_text().count("gpuctl-setup: pip install tensorflow-cpu") == 2


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
