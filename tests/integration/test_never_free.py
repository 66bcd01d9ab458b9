"""Nothing an instance writes makes a run look free: the local provider at $3.60/h (real tmux, a
real job), whose job writes the files gpuctl reads its time and dollars from.

Bad inputs tried: epoch reports that agree with themselves on 0 s and $0.000000001 (start = end), a job's
own `started` file put an hour ahead (so that it ran 0 s by its files) while it runs on until
`gpuctl stop`."""

from __future__ import annotations

import json
import time

from tests.integration.test_deadlines import wait_for

RATE = "3.6"

ZERO_EPOCHS = """
import json, os, time
d = os.environ["GPUCTL_RUN_DIR"]
with open(os.path.join(d, "epochs.jsonl"), "a") as fh:
    for epoch in (1, 2):
        now = time.time()
        fh.write(json.dumps({"schema": 1, "run_id": os.environ["GPUCTL_RUN_ID"], "epoch": epoch, "epochs_planned": 10,
                             "start": now, "end": now, "seconds": 0, "usd_per_hour": 0, "epoch_cost_usd": 1e-9,
                             "cumulative_usd": epoch * 1e-9}) + "\\n")
time.sleep(2)
"""

NO_TIME = """
import os, time
d = os.environ["GPUCTL_RUN_DIR"]
with open(os.path.join(d, "started"), "w") as fh:  # an hour ahead: the job's end comes "before" it
    fh.write(str(time.time() + 3600))
print("wrote", flush=True)
time.sleep(600)
"""


def test_epochs_that_say_they_cost_nothing_cost_the_runs_time(gpuctl, make_project):
    gpuctl("up", "--provider", "local", "--usd-per-hour", RATE, "-y")
    run = json.loads(gpuctl("train", make_project("zero", {"train.py": ZERO_EPOCHS}), "--wait", "--json").stdout)
    rc = next(r for r in json.loads(gpuctl("cost", "--json").stdout)["runs"] if r["run_id"] == run["run"]["run_id"])
    assert rc["epochs_done"] == 2
    assert rc["spent_usd"] >= 2 * 3.6 / 3600, rc  # it ran 2 s at least, at $3.60/h
    assert rc["projected_total_usd"] >= 10 / 2 * rc["spent_usd"] * 0.99, rc
    gpuctl("down", "-y")


def test_a_job_that_moves_its_own_start_is_billed_until_it_was_stopped(gpuctl, make_project, isolated):
    gpuctl("up", "--provider", "local", "--usd-per-hour", RATE, "-y")
    run = json.loads(gpuctl("train", make_project("no-time", {"train.py": NO_TIME}), "--json").stdout)["run"]
    wait_for(lambda: "wrote" in gpuctl("logs", run["run_id"]).stdout)
    time.sleep(2)  # it runs on: 2 s of it are billed whatever its files say
    gpuctl("stop", run["run_id"])
    status = json.loads(gpuctl("status", "--json").stdout)
    (shown,) = [r for r in status["runs"] if r["run_id"] == run["run_id"]]
    assert shown["elapsed_s"] >= 2 and shown["usd"] >= 2 * 3.6 / 3600, shown
    gpuctl("down", "-y")
