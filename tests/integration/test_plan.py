"""`gpuctl plan` on real parts: local clusters (real tmux, the real payload) and an sshd test host,
probing plain-Python jobs that report through the public API (`from gpuctl_report import epoch`),
so nothing here imports TensorFlow in the script. The probes' runs stop after --probe-epochs
without the script's help; the projection is ready + first + (N-1) x steady.

The one stand-in: nvidia-smi (no GPU can exist on these machines), a script on the job's PATH that
answers as the real one does, busy or starved.

Bad inputs tried (each one Error/Hint pair, exit code, nothing launched or run): nothing to probe,
--probe-epochs 0, --epochs below --probe-epochs, a worst case above --max-usd, a --cluster that is
down, --type on the local provider, --from-history with --cluster, a bad --probe-timeout, a plan
of a project without its entry point. (An unknown --type: test_plan_aws.py, on moto.)"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from gpuctl.ledger import Ledger
from tests.integration.test_payload_tf import MODEL
from tests.integration.test_ssh import up_ssh

# Start-up, then one epoch of 0.6 s (warm-up) and steady ones of 0.3 s, each x the slowdown a
# test host sets in its own /srv (a slower machine); the loop's end is never reached under a plan.
PROBED = '''
import os, sys, time
from gpuctl_report import epoch
slow = float(open("/srv/slowdown").read()) if os.path.exists("/srv/slowdown") else 1.0
epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 10
time.sleep(0.2)
for n in range(epochs):
    with epoch(examples=1000, planned=epochs) as e:
        time.sleep((0.6 if n == 0 else 0.3) * slow)
        e.metrics(loss=1.0 / (n + 1))
print("after the loop", flush=True)
'''


@pytest.fixture
def probed(make_project):
    return make_project("probed", {"train.py": PROBED})


def plan_json(gpuctl, *args, code=0):
    res = gpuctl("plan", "--json", *args, code=code)
    return json.loads(res.stdout) if code == 0 else res


def rows(report):
    return {r["label"]: r for r in report["rows"]}


def assert_projection(row, epochs):
    """The projection is ready + first + (N-1) x steady, and its dollars that time at the rate."""
    want = row["ready_s"] + row["first_epoch_s"] + (epochs - 1) * row["steady_epoch_s"]
    assert row["projected_s"] == pytest.approx(want, abs=1e-6)
    assert row["projected_usd"] == pytest.approx(want * row["usd_per_hour"] / 3600, abs=1e-9)


def test_two_local_clusters_of_one_speed_rank_by_dollars_and_stay_up(gpuctl, probed, isolated):
    gpuctl("up", "--name", "cheap", "--usd-per-hour", "1", "-y")
    gpuctl("up", "--name", "dear", "--usd-per-hour", "3", "-y")
    report = plan_json(gpuctl, probed, "--cluster", "dear", "--cluster", "cheap", "--epochs", "20", "--",
                       "--epochs", "10")
    cheap, dear = rows(report)["cluster cheap"], rows(report)["cluster dear"]
    assert (cheap["rank"], dear["rank"]) == (1, 2) and cheap["outcome"] == dear["outcome"] == "ok"
    for row, rate in ((cheap, 1.0), (dear, 3.0)):
        assert row["usd_per_hour"] == rate and row["steady_epochs"] == 1
        assert row["first_epoch_s"] == pytest.approx(0.6, abs=0.25) and row["steady_epoch_s"] == pytest.approx(0.3, abs=0.2)
        assert row["examples_per_s"] > 0 and row["gpu_util_percent"] is None  # no nvidia-smi here: n/a
        assert row["ready_s"] > 0  # the push, the job's start, the script's start-up (under a second here)
        assert_projection(row, 20)
        assert row["probe_usd"] > 0
    assert report["recommendation"] == f"gpuctl train {probed} --cluster cheap -- --epochs 10"
    assert report["plan_usd"] == pytest.approx(cheap["probe_usd"] + dear["probe_usd"])
    # Each probe ran 2 epochs and ended there by itself (exit 0) without the script's help.
    cost = json.loads(gpuctl("cost", "--json").stdout)
    probes = {r["cluster"]: r for r in cost["runs"]}
    assert {r["run_id"] for r in probes.values()} == {cheap["run_id"], dear["run_id"]}
    for r in probes.values():
        assert r["state"] == "succeeded" and r["epochs_done"] == 2 and r["epochs_planned"] == 10
        assert "after the loop" not in gpuctl("logs", r["run_id"]).stdout
    assert "ending the run here" in gpuctl("logs", cheap["run_id"]).stdout
    # Clusters that were up stay up, and the default stays what it was.
    status = json.loads(gpuctl("status", "--json").stdout)
    assert {c["name"]: c["state"] for c in status["clusters"]} == {"cheap": "up", "dear": "up"}
    # The table: ranked, the fastest marked, the command, what the plan cost.
    table = gpuctl("plan", "--from-history", probed, "--epochs", "20").stdout
    assert "cluster cheap" in table and cheap["run_id"] in table and "Cheapest for 20 epochs: cluster cheap" in table
    history = rows(plan_json(gpuctl, "--from-history", probed, "--epochs", "40"))
    assert history["cluster cheap"]["run_id"] == cheap["run_id"] and history["cluster cheap"]["rank"] == 1
    assert_projection(history["cluster dear"], 40)


def test_the_table_ranks_marks_the_fastest_and_says_what_the_plan_cost(gpuctl, probed):
    gpuctl("up", "--name", "solo", "--usd-per-hour", "2", "-y")
    out = gpuctl("plan", probed, "--cluster", "solo", "--epochs", "5", "--probe-epochs", "1").stdout
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["#", "machine"] and "time for 5" in lines[0] and "$ for 5" in lines[0]
    assert lines[1].split()[:3] == ["1", "cluster", "solo"] and lines[1].endswith("fastest")
    assert "one epoch only, compilation and warm-up included" in out  # --probe-epochs 1: no steady epoch measured
    assert "Cheapest for 5 epochs: cluster solo" in out and "This plan cost $" in out


NVIDIA_SMI = '''#!/bin/sh
# Stands in for nvidia-smi: one GPU, busy (95%) or starved (35%) as the run's cluster is named.
case "$*" in *-L*) echo "GPU 0: Fake A10G (UUID: GPU-0)"; exit 0;; esac
case "$GPUCTL_RUN_DIR" in *starved*) util=35;; *) util=95;; esac
echo "$util, 20480, 23028"
'''


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("GPUCTL_TRAIN__GPU_SAMPLE_S", "0.1")


def test_gpu_use_from_nvidia_smi_and_the_hint_only_for_a_starved_gpu(gpuctl, probed, fake_gpu):
    gpuctl("up", "--name", "busy", "--usd-per-hour", "1", "-y")
    gpuctl("up", "--name", "starved", "--usd-per-hour", "1", "-y")
    report = plan_json(gpuctl, probed, "--cluster", "busy", "--cluster", "starved", "--epochs", "10")
    busy, starved = rows(report)["cluster busy"], rows(report)["cluster starved"]
    assert busy["gpu_util_percent"] == pytest.approx(95) and starved["gpu_util_percent"] == pytest.approx(35)
    assert busy["gpu_memory_used_mib"] == 20480 and busy["gpu_memory_total_mib"] == 23028
    (hint,) = report["notes"]
    assert hint.startswith("cluster starved: the GPU was busy 35%") and "input pipeline" in hint
    # Each epoch's report carries them too (cost --json).
    epochs = [e for r in json.loads(gpuctl("cost", "--json").stdout)["runs"] for e in r["epochs"]]
    assert {e["gpu_util_percent"] for e in epochs} == {95.0, 35.0}
    table = gpuctl("plan", "--from-history", probed, "--epochs", "10").stdout
    assert "95%" in table and "35%" in table and "20.0/22 GiB" in table
    assert table.count("input pipeline is the bottleneck") == 1


def test_a_slower_ssh_host_wins_only_when_its_speed_beats_its_price(gpuctl, probed, ssh):
    """An ssh host at $1/h whose job runs 3x slower (the host says so in its own /srv) against a
    local cluster: at $2/h (price ratio 2, speed ratio 3) the faster one wins; at $6/h it loses."""
    host = ssh.hosts[0]
    host.run("echo 3 > /srv/slowdown")
    up_ssh(gpuctl, ssh, name="slowbox", extra=("--usd-per-hour", "1", "-y"))
    gpuctl("up", "--name", "fast", "--usd-per-hour", "2", "-y")  # 3x faster for 2x the price: wins
    # --allow-cpu: the test host has no GPU, and a remote host's preflight refuses that otherwise.
    first = rows(plan_json(gpuctl, probed, "--cluster", "slowbox", "--cluster", "fast", "--epochs", "200",
                           "--probe-timeout", "10m", "--allow-cpu"))
    slow, fast = first["cluster slowbox"], first["cluster fast"]
    assert slow["outcome"] == fast["outcome"] == "ok", first
    assert slow["steady_epoch_s"] > 2.2 * fast["steady_epoch_s"]  # the host really ran slower
    assert fast["rank"] == 1 and fast["fastest"] and slow["rank"] == 2
    assert_projection(slow, 200)
    gpuctl("down", "fast", "-y")
    gpuctl("up", "--name", "fast", "--usd-per-hour", "6", "-y")  # 3x faster for 6x the price: loses
    second = rows(plan_json(gpuctl, probed, "--cluster", "slowbox", "--cluster", "fast", "--epochs", "200",
                            "--probe-timeout", "10m", "--allow-cpu"))
    assert second["cluster slowbox"]["rank"] == 1 and second["cluster fast"]["rank"] == 2
    assert second["cluster fast"]["fastest"]
    gpuctl("down", "slowbox", "-y")
    gpuctl("down", "fast", "-y")


NO_API = '''
import time
time.sleep(0.6)
print("trained without reporting", flush=True)
'''


def test_a_run_that_reports_no_epoch_costs_its_wall_time(gpuctl, make_project):
    """A custom loop without the report API: `cost` showed 0/? epochs and $0.0000 for it."""
    proj = make_project("noapi", {"train.py": NO_API})
    gpuctl("up", "--usd-per-hour", "3600", "-y")
    gpuctl("train", proj, "--wait")
    (run,) = json.loads(gpuctl("cost", "--json").stdout)["runs"]
    assert run["epochs_done"] == 0 and run["spent_from"] == "wall time"
    assert run["spent_usd"] == pytest.approx(run["wall_s"], rel=1e-6) and run["wall_s"] >= 0.6
    out = gpuctl("cost").stdout
    assert " wall" in out and "no epoch reported: its" in out and "$0.0000" not in out.split("\n\n")[1]
    # A plan of it says it measured nothing, and why, and exits 8 after its report (a script must
    # not read an empty ranking as success).
    res = plan_json(gpuctl, proj, "--cluster", "default", "--epochs", "10", "--max-usd", "2000", code=8)
    report = json.loads(res.stdout)
    (row,) = report["rows"]
    assert row["outcome"] == "no epochs" and "gpuctl_report" in row["problem"] and report["recommendation"] is None
    assert "Error: no machine was measured" in res.stderr


def test_bad_inputs_are_one_error_each_and_launch_nothing(gpuctl, probed, make_project, isolated):
    gpuctl("up", "--name", "lab", "--usd-per-hour", "10", "-y")
    gpuctl("up", "--name", "gone", "-y")
    gpuctl("down", "gone", "-y")
    cases = [
        ((probed, "--epochs", "10"), 3, "nothing to probe"),
        ((probed, "--cluster", "lab", "--epochs", "10", "--probe-epochs", "0"), 3, "--probe-epochs 0"),
        ((probed, "--cluster", "lab", "--epochs", "1"), 3, "--epochs 1 is below --probe-epochs 2"),
        ((probed, "--cluster", "lab", "--epochs", "10"), 3, "worst case, $5.00"),  # $10/h x 30 min > $2
        ((probed, "--cluster", "gone", "--epochs", "10"), 4, "no cluster named 'gone' is up"),
        ((probed, "--type", "g5.xlarge", "--epochs", "10"), 3, "the local provider's machines are what they are"),
        ((probed, "--cluster", "lab", "--epochs", "10", "--probe-timeout", "soon"), 3, "--probe-timeout 'soon'"),
        ((make_project("empty", {}), "--cluster", "lab", "--epochs", "10"), 6, "no entry point"),
        (("--from-history", probed, "--cluster", "lab", "--epochs", "10"), 3, "--from-history launches nothing"),
        (("--from-history", probed, "--epochs", "10"), 4, "no past run of"),
        # Options that would be silently ignored are refused; a timeout too short to measure too.
        (("--from-history", probed, "--epochs", "10", "--max-usd", "5"), 3, "--max-usd cannot go with it"),
        ((probed, "--cluster", "lab", "--epochs", "10", "--spot"), 3, "--spot/--on-demand is the market of --type"),
        ((probed, "--cluster", "lab", "--epochs", "10", "--probe-timeout", "30"), 3, "of 1 minute to a day"),
    ]
    for args, code, says in cases:
        res = gpuctl("plan", *args, code=code)
        err = res.stderr.strip().splitlines()
        assert len(err) == 2 and err[0].startswith("Error: ") and err[1].startswith("Hint: "), res.stderr
        assert says in err[0], (args, res.stderr)
        assert res.stdout == ""
    led = Ledger(isolated)
    assert led.runs() == [] and [c.name for c in led.clusters(include_down=False)] == ["lab"]
    # Within the budget it runs: the worst case is what the hint says to raise.
    ok = plan_json(gpuctl, probed, "--cluster", "lab", "--epochs", "10", "--max-usd", "5",
                   "--probe-timeout", "20m")
    assert ok["worst_case_usd"] == pytest.approx(10 * 20 / 60) and ok["rows"][0]["rank"] == 1


# A custom training loop (tf.GradientTape), the style TensorFlow's guides teach: it reports each
# epoch through the public API, and the probe ends it after K epochs through that API.
TAPE = textwrap.dedent(MODEL) + '''
from gpuctl_report import epoch
optimizer = tf.keras.optimizers.Adam(1e-2)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(20)
EPOCHS = 30
for n in range(EPOCHS):
    with epoch(examples=len(x), planned=EPOCHS) as e:
        for bx, by in dataset:
            with tf.GradientTape() as tape:
                loss = loss_fn(by, model(bx, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        e.metrics(loss=float(loss))
print("after the loop", flush=True)
'''


@pytest.mark.tf
def test_a_gradient_tape_loop_reports_its_epochs_to_cost_and_plan(gpuctl, make_project):
    proj = make_project("tape", {"train.py": TAPE})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    report = plan_json(gpuctl, proj, "--cluster", "default", "--epochs", "30", "--probe-epochs", "3")
    (row,) = report["rows"]
    assert row["outcome"] == "ok" and row["rank"] == 1 and row["steady_epochs"] == 2 and row["examples_per_s"] > 0
    assert_projection(row, 30)
    (run,) = json.loads(gpuctl("cost", "--json").stdout)["runs"]
    assert run["state"] == "succeeded" and run["epochs_done"] == 3 and run["epochs_planned"] == 30
    assert run["spent_from"] == "epochs" and all(e["examples"] == 100 for e in run["epochs"])
    assert all(e["examples_per_s"] > 0 and e["epoch_cost_usd"] > 0 and "loss" in e["metrics"] for e in run["epochs"])
    assert "after the loop" not in gpuctl("logs", run["run_id"]).stdout
