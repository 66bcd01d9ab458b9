"""`gpuctl plan --type` on aws: a moto server over HTTP, each type's instance mapped to its own real
sshd test host by the test seam (GPUCTL_TEST_ENDPOINTS `type:T=HOST`), the probes' runs plain
Python through the real payload (--allow-cpu: the hosts have no GPU). The probe clusters are
launched at once, measured, released; their dollars stay in `cost`; one whose run fails is shown
with its log's last line while the others are ranked; a plan killed with SIGKILL leaves nothing
`down --all` cannot release.

moto's spot price is a dummy ($0.00001/h in every zone), so the probes run on demand, priced from
gpuctl's dated table (moto has no Price List API): g4dn.xlarge $0.526/h, g5.xlarge $1.006/h,
g6.xlarge $0.8048/h. Every guard's poweroff on a test host only leaves a mark in its own /srv.

Bad inputs tried: an unknown type (did-you-mean, nothing created), a worst case above --max-usd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from gpuctl.ledger import Ledger
from tests import sshd
from tests.aws import live_instances, nothing_created
from tests.conftest import use_hosts
from tests.integration.test_aws_e2e import cloud_init
from tests.integration.test_guards import wait_for
from tests.integration.test_plan import PROBED

TYPES = ("g4dn.xlarge", "g5.xlarge", "g6.xlarge")


@pytest.fixture(scope="module")
def plan_hosts():
    """Three test hosts of their own: an aws cluster works in the host's /srv/gpuctl with tmux
    server "gpuctl", so two probe clusters never share a host."""
    with sshd.running_lab("plan-hosts", {10: "p10", 11: "p11", 12: "p12"}) as (_, hosts):
        yield hosts


@pytest.fixture
def lab(aws, plan_hosts, monkeypatch, isolated, make_project):
    use_hosts(plan_hosts, monkeypatch)
    monkeypatch.setenv("GPUCTL_AWS__SSH_USER", "root")
    monkeypatch.setenv("GPUCTL_AWS__SSH_CIDR", "203.0.113.5/32")  # `up --ssh-cidr` for every probe cluster
    monkeypatch.setenv("GPUCTL_TEST_ENDPOINTS", ",".join(f"type:{t}={h.ip}" for t, h in zip(TYPES, plan_hosts)))
    # A probe powers off a grace period after its run: on a test host that is a mark in its /srv.
    monkeypatch.setenv("GPUCTL_GUARDS__POWEROFF_COMMAND", "date +%s >> /srv/POWEROFF")
    keys = [h.base / "authorized_keys" for h in plan_hosts]
    saved = [k.read_text() for k in keys]
    installers = [cloud_init(h, isolated, f"plan-*-{t.replace('.', '-')}") for t, h in zip(TYPES, plan_hosts)]
    yield aws, plan_hosts, make_project("probed", {"train.py": PROBED})
    for installer in installers:
        installer.join(0)
    for key, text in zip(keys, saved):
        key.write_text(text)


def json_of(stdout: str) -> dict:
    """The JSON gpuctl printed. The moto server runs in this process and prints its own complaint
    (no Price List API) on the same stdout, before it."""
    return json.loads(stdout[stdout.index("{\n"):])


def test_one_probe_cluster_per_type_at_once_ranked_released_and_in_cost(gpuctl, lab, isolated):
    aws, hosts, proj = lab
    hosts[1].run("touch /srv/fail")  # the g5.xlarge probe's run fails there
    (proj / "train.py").write_text("import os\nif os.path.exists('/srv/fail'):\n    print('loading', flush=True)\n"
                                   "    raise RuntimeError('CUDA error: out of memory on this host')\n"
                                   + PROBED)
    res = gpuctl("plan", proj, *[a for t in TYPES for a in ("--type", t)], "--on-demand", "--epochs", "50",
                 "--allow-cpu", "--max-usd", "3", "-y", "--json", "--", "--epochs", "10")
    report = json_of(res.stdout)
    by_type = {r["instance_type"]: r for r in report["rows"]}
    g4dn, g5, g6 = (by_type[t] for t in TYPES)
    assert g4dn["outcome"] == g6["outcome"] == "ok", [r["problem"] for r in report["rows"]]
    assert (g4dn["rank"], g6["rank"]) == (1, 2) and g5["rank"] is None  # same speed: by price
    assert g5["outcome"] == "failed" and g5["problem"] == "RuntimeError: CUDA error: out of memory on this host"
    assert g4dn["usd_per_hour"] == 0.526 and g6["usd_per_hour"] == 0.8048 and g4dn["market"] == "on-demand"
    for row in (g4dn, g6):
        want = row["ready_s"] + row["first_epoch_s"] + 49 * row["steady_epoch_s"]
        assert row["projected_s"] == pytest.approx(want) and row["gpu_util_percent"] is None
    # The run as probed: --allow-cpu too (the hosts have no GPU).
    assert report["recommendation"] == (f"gpuctl up --type g4dn.xlarge --on-demand && gpuctl train {proj} --allow-cpu "
                                        "-- --epochs 10")
    # Launched together (each up before any was released), each released, none the default.
    led = Ledger(isolated)
    probes = [c for c in led.clusters() if c.name.startswith("plan-")]
    assert sorted(c.spec.instance_type for c in probes) == sorted(TYPES)
    assert max(c.created_at for c in probes) < min(c.terminated_at for c in probes)
    assert all(c.state == "down" and c.spec.max_hours == 1.0 and not c.is_default for c in probes)
    assert led.default_cluster() is None
    nothing_created(aws)
    for h in hosts:
        h.run("rm -f /srv/fail")
    # Their dollars stay in `cost`, and the plan said what they came to.
    costs = {c["name"]: c for c in json.loads(gpuctl("cost", "--json").stdout)["clusters"]}
    assert {c.name for c in probes} <= set(costs) and all(costs[c.name]["usd"] > 0 for c in probes)
    assert report["plan_usd"] == pytest.approx(sum(costs[c.name]["usd"] for c in probes), rel=0.05)
    assert "probe cluster" in res.stderr and "releasing probe cluster plan-" in res.stderr


def test_unknown_type_and_a_worst_case_above_the_limit_launch_nothing(gpuctl, lab, isolated):
    aws, _, proj = lab
    res = gpuctl("plan", proj, "--type", "g5.xlarge", "--type", "g5.xlareg", "--epochs", "10", "-y", code=3)
    assert "unknown instance type 'g5.xlareg'" in res.stderr and "Did you mean 'g5.xlarge'?" in res.stderr
    res = gpuctl("plan", proj, "--type", "g5.xlarge", "--type", "g4dn.xlarge", "--on-demand", "--epochs", "10",
                 "--max-usd", "1", "-y", code=3)
    assert "worst case, $1.53" in res.stderr and "g5.xlarge on-demand $1.0060/h x 1 h" in res.stderr
    nothing_created(aws)
    assert Ledger(isolated).clusters() == []


def plan_in_background(proj, isolated, sig):
    """`gpuctl plan` of one type as a process of its own, sent `sig` once its probe's run runs (its
    epochs are long: it is still in its first)."""
    argv = [sys.executable, "-m", "gpuctl", "plan", str(proj), "--type", "g4dn.xlarge", "--on-demand", "--epochs",
            "50", "--allow-cpu", "-y", "--", "--epochs", "1000"]
    (proj / "train.py").write_text(PROBED.replace("(0.6 if n == 0 else 0.3)", "30"))
    plan = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        wait_for(lambda: any(r.state == "running" for r in Ledger(isolated).runs()), timeout=180)
    finally:
        plan.send_signal(sig)
    out, err = plan.communicate(timeout=120)
    return plan.returncode, err


def test_ctrl_c_stops_the_probes_and_releases_their_clusters(gpuctl, lab, isolated):
    aws, _, proj = lab
    code, err = plan_in_background(proj, isolated, signal.SIGINT)
    assert code == 130 and "interrupted: stopping the probes and releasing their clusters" in err, err
    assert "releasing probe cluster plan-" in err
    nothing_created(aws)  # no `down` needed
    (run,) = Ledger(isolated).runs()
    assert run.state == "stopped" and all(c.state == "down" for c in Ledger(isolated).clusters())


def test_a_plan_killed_with_sigkill_leaves_nothing_down_all_cannot_release(gpuctl, lab, isolated):
    aws, _, proj = lab
    code, _ = plan_in_background(proj, isolated, signal.SIGKILL)
    assert code == -signal.SIGKILL
    (inst,) = live_instances(aws)
    found = json.loads(gpuctl("status", "--all", "--json").stdout)
    assert inst["InstanceId"] in {r["id"] for r in found["resources"]}
    assert any(c.startswith("plan-") for c in found["ledger_clusters"])
    gpuctl("down", "--all", "-y")
    nothing_created(aws)
    assert all(c.state == "down" for c in Ledger(isolated).clusters())
    (run,) = Ledger(isolated).runs()
    assert run.state == "stopped"  # down --all stopped the probe's job before releasing its cluster
