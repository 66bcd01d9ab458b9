"""`gpuctl watch`: the supervisor that follows a run until it ends (and recovers it: see
test_spot_recovery.py), in the foreground or detached from the terminal. On the local provider,
whose runs nothing interrupts.

Bad inputs tried: an unknown run (exit 4, nothing started); a script that exits 75 (the code a
preempted run ends with) on its own."""

from __future__ import annotations

import json
import os
import re

from tests.waits import wait_for


def test_watch_follows_a_run_to_its_end_in_the_foreground_and_detached(gpuctl, quick_project, isolated):
    gpuctl("up", "--provider", "local", "-y")
    run_id = json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["run_id"]
    res = gpuctl("watch", run_id)
    assert f"watching run {run_id}" in res.stderr and f"run {run_id} succeeded" in res.stderr

    second = json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["run_id"]
    out = gpuctl("watch", "--detach").stdout  # the latest run
    assert f"Watching run {second} in the background" in out
    pid = int(re.search(r"pid (\d+)", out).group(1))
    log = isolated / "logs" / f"watch-{second}.log"
    # the supervisor is this test's child: reap it
    wait_for(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0), 120, "the detached watch's end")
    assert log.stat().st_mode & 0o777 == 0o600
    assert f"run {second} succeeded" in log.read_text()

    assert "no run" in gpuctl("watch", "nope", code=4).stderr.lower()
    # --recover belongs to --wait: refused before any run starts.
    assert "--recover/--no-recover is for --wait" in gpuctl("train", quick_project, "--recover", code=2).stderr
    assert len(json.loads(gpuctl("status", "--json").stdout)["runs"]) == 2


def test_a_script_that_exits_75_itself_is_failed_not_preempted(gpuctl, make_project):
    """Exit 75 means preempted only with the launcher's mark (a notice stopped it): a script's own
    exit 75 is a failure, and nothing tries to recover it."""
    gpuctl("up", "--provider", "local", "-y")
    proj = make_project("tempfail", {"train.py": "raise SystemExit(75)\n"})
    res = gpuctl("train", proj, "--wait", code=8)
    assert "failed (exit code 75)" in res.stderr and "recover" not in res.stderr
    run = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    assert run["state"] == "failed" and run["exit_code"] == 75 and not run["segments"][0]["end"] == "preempted"
