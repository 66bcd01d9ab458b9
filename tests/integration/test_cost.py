"""The cost report: exact dollars from the ledger for constructed cloud timelines, the payload's
epoch costs against the billing rules on a real local run, CSV, compare and the plot.

Bad inputs tried: an unknown run id, --compare with one run, a plot path in a missing directory."""

from __future__ import annotations

import csv
import io
import json

import pytest

from gpuctl.ledger import Ledger
from gpuctl.model import billing
from gpuctl.model.records import InstanceRecord
from gpuctl.model.specs import AwsSpec

H = 3600.0


def aws_cluster(home, name, launched, ended, steps, market="spot", od=1.006, disk=100):
    led = Ledger(home)
    c = led.add_cluster(AwsSpec(name=name, instance_type="g5.xlarge", market=market,
                                    disk_gb=disk, billing="per-second"))
    led.put_instance(c.id, InstanceRecord(
        id=f"i-{name}", cluster=name, state="terminated", launched_at=launched, terminated_at=ended,
        workdir="~/gpuctl", market=market, usd_per_hour=steps[0][1], price_steps=tuple(steps),
        on_demand_usd_per_hour=od, instance_type="g5.xlarge", region="us-east-1", zone="us-east-1a",
    ))
    led.mark_cluster_down(c.id, ended)


def cluster_costs(gpuctl):
    return {c["name"]: c for c in json.loads(gpuctl("cost", "--json").stdout)["clusters"]}


def test_exact_dollars_for_cloud_timelines_from_the_ledger(gpuctl, isolated):
    t0 = 1_700_000_000.0
    aws_cluster(isolated, "short", t0, t0 + 30, [(t0, 3.6)])  # 30 s: billed the 60 s minimum
    aws_cluster(isolated, "spot-change", t0, t0 + 2 * H, [(t0, 0.40), (t0 + 1800, 0.60), (t0 + 5400, 0.30)])
    aws_cluster(isolated, "guarded", t0, t0 + 2.5 * H, [(t0, 1.006)], market="on-demand")
    costs = cluster_costs(gpuctl)
    assert costs["short"]["compute_usd"] == pytest.approx(0.06)
    assert costs["spot-change"]["compute_usd"] == pytest.approx(0.5 * 0.40 + 1.0 * 0.60 + 0.5 * 0.30)
    assert costs["guarded"]["compute_usd"] == pytest.approx(2.5 * 1.006)
    for name, hours in (("short", 30 / H), ("spot-change", 2.0), ("guarded", 2.5)):
        assert costs[name]["storage_usd"] == pytest.approx(100 * 0.08 * hours / 730)
        assert costs[name]["usd"] == pytest.approx(costs[name]["compute_usd"] + costs[name]["storage_usd"])
    # Spot savings against on-demand of the same type over the billed time; none for on-demand.
    assert costs["spot-change"]["spot_savings_usd"] == pytest.approx(2 * 1.006 - 0.95)
    assert costs["guarded"]["spot_savings_usd"] is None
    # Nothing ran on them: all of it is idle overhead.
    assert costs["guarded"]["idle_usd"] == pytest.approx(costs["guarded"]["usd"])


def test_payload_epoch_costs_agree_with_the_billing_rules_on_a_real_run(gpuctl, quick_project):
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", quick_project, "--wait", "--", "--epochs", "3")
    gpuctl("train", quick_project, "--wait", "--", "--epochs", "2")
    report = json.loads(gpuctl("cost", "--json").stdout)
    for run in report["runs"]:
        for e in run["epochs"]:
            # seconds x $3.6/h = seconds / 1000, within 1%
            assert e["epoch_cost_usd"] == pytest.approx(e["seconds"] / 1000, rel=0.01)
            assert e["epoch_cost_usd"] == pytest.approx(billing.integrate(0, e["seconds"], [(0, 3.6)]), rel=0.01)
        assert run["projected_total_usd"] == pytest.approx(run["mean_epoch_usd"] * run["epochs_planned"])
        assert run["usd_per_million_examples"] == pytest.approx(run["spent_usd"] / (100 * run["epochs_done"]) * 1e6)
        assert run["examples_per_s"] > 0 and run["projected_finish_at"] > 0
    (cluster,) = report["clusters"]
    spent = sum(r["spent_usd"] for r in report["runs"])
    assert cluster["idle_usd"] == pytest.approx(cluster["usd"] - spent, abs=1e-4)

    rows = list(csv.DictReader(io.StringIO(gpuctl("cost", "--csv").stdout)))
    assert len(rows) == 5 and {r["run_id"] for r in rows} == {r["run_id"] for r in report["runs"]}
    assert rows[0]["epoch"] == "1" and float(rows[0]["epoch_cost_usd"]) > 0

    a, b = (r["run_id"] for r in report["runs"])
    table = gpuctl("cost", "--compare", a, b).stdout
    for label in ("instance type", "market", "epoch time", "$/epoch", "projected total"):
        assert label in table
    assert a in table and b in table


def test_plot_is_a_readable_png_with_every_run(gpuctl, quick_project, tmp_path):
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", quick_project, "--wait", "--", "--epochs", "3")
    gpuctl("train", quick_project, "--wait", "--", "--epochs", "4")
    out = tmp_path / "cost.png"
    res = gpuctl("cost", "--plot", out)
    assert "(2 run(s))" in res.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image as mpimg

    pixels = mpimg.imread(out)
    assert pixels.shape[1] > 1000 and pixels.std() > 0.05  # drawn on, not blank


def test_bad_cost_inputs(gpuctl, quick_project, tmp_path):
    gpuctl("up")
    gpuctl("train", quick_project, "--wait")
    run_id = json.loads(gpuctl("status", "--json").stdout)["runs"][0]["run_id"]
    assert "no run named 'nope'" in gpuctl("cost", "nope", code=4).stderr
    assert "--compare needs at least two runs" in gpuctl("cost", "--compare", run_id, code=3).stderr
    res = gpuctl("cost", "--plot", tmp_path / "missing" / "cost.png", code=3)
    assert "does not exist" in res.stderr and not (tmp_path / "missing").exists()
