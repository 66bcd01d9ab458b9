"""The bill itself (issue 41): `gpuctl aws billing setup` activates gpuctl's tags as cost allocation
tags and says their state; `gpuctl cost --billed` puts Cost Explorer's unblended cost (moto answers
GetCostAndUsage with results the test queues, tests/aws_billing.py) beside gpuctl's estimate of
each cluster, a reused name told apart by the days each cluster lived, drift named by its part,
what is not billed yet marked; answers cached in the ledger (each request costs $0.01).

Bad inputs tried: a bad --since date, one in the future, --since/--refresh without --billed, tags
not activated, no permission for ce:GetCostAndUsage or ce:ListCostAllocationTags, an answer past
its page bound; each changes nothing in the cloud and says what to do."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest

from gpuctl.ledger import Ledger
from gpuctl.model.records import InstanceRecord
from gpuctl.model.specs import AwsSpec
from tests.aws_billing import (
    GPUCTL_KEYS,
    ce_requests,
    cost_allocation_tags_as_aws_does,
    day_result,
    deny,
    queue_bill,
)

H = 3600.0
COMPUTE, OTHER, TRANSFER, S3 = ("Amazon Elastic Compute Cloud - Compute", "EC2 - Other", "AWS Data Transfer",
                                "Amazon Simple Storage Service")


def at(days_ago: int, hour: float) -> float:
    """A moment `days_ago` days before today (UTC) at `hour`."""
    midnight = dt.datetime.combine(dt.datetime.now(dt.timezone.utc).date(), dt.time(), dt.timezone.utc)
    return (midnight - dt.timedelta(days=days_ago)).timestamp() + hour * H


def day(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).date().isoformat()


def aws_cluster(home, name, launched, ended, rate=1.006, disk=100) -> int:
    """A released on-demand cluster as the ledger keeps it (one instance, launched..ended)."""
    led = Ledger(home)
    c = led.add_cluster(AwsSpec(name=name, instance_type="g5.xlarge", market="on-demand", disk_gb=disk,
                                billing="per-second"))
    led.put_instance(c.id, InstanceRecord(
        id=f"i-{name}{c.id}", cluster=name, state="terminated", launched_at=launched, terminated_at=ended,
        workdir="~/gpuctl", market="on-demand", usd_per_hour=rate, instance_type="g5.xlarge",
        region="us-east-1", zone="us-east-1a"))
    led.mark_cluster_down(c.id, ended)
    with led.write() as db:  # `up` made it then, not now
        db.execute("UPDATE clusters SET created_at = ? WHERE id = ?", (launched - 60, c.id))
    led.close()
    return c.id


@pytest.fixture
def tags_active(monkeypatch, aws):
    return cost_allocation_tags_as_aws_does(monkeypatch, active=GPUCTL_KEYS)


def test_setup_activates_the_tags_and_says_their_state(gpuctl, aws, monkeypatch):
    # AWS has seen two of the keys on resources; gpuctl:owner not yet (no resource carried it).
    state = cost_allocation_tags_as_aws_does(monkeypatch, seen=("gpuctl:cluster", "gpuctl:created-by"))
    out = gpuctl("aws", "billing", "setup")
    assert state == {"gpuctl:cluster": "Active", "gpuctl:created-by": "Active"}
    assert "gpuctl:cluster" in out.stdout and "active" in out.stdout.lower()
    assert "gpuctl:owner" in out.stdout and "not seen" in out.stdout
    assert "from activation on" in out.stdout and "up to a day" in out.stdout
    shown = json.loads(gpuctl("aws", "billing", "setup", "--json").stdout)
    assert {t["key"]: t["status"] for t in shown["tags"]} == {
        "gpuctl:cluster": "Active", "gpuctl:owner": "not seen yet", "gpuctl:created-by": "Active"}
    assert shown["activated"] == []  # the second time: nothing left to activate


def test_setup_without_permission_names_the_action(gpuctl, aws, monkeypatch):
    from moto.ce.responses import CostExplorerResponse

    cost_allocation_tags_as_aws_does(monkeypatch)
    deny(monkeypatch, CostExplorerResponse, "list_cost_allocation_tags", "ce:ListCostAllocationTags")
    err = gpuctl("aws", "billing", "setup", code=9).stderr
    assert "Error: not allowed to call ce:ListCostAllocationTags" in err and "docs/aws-iam.md" in err


@pytest.fixture
def history(isolated):
    """Four clusters gone, one of them under the name of an earlier one; one released an hour ago."""
    first = aws_cluster(isolated, "a", at(5, 10), at(5, 12))  # 2 h
    b = aws_cluster(isolated, "b", at(4, 12), at(4, 13))  # 1 h
    second = aws_cluster(isolated, "a", at(3, 10), at(3, 14))  # 4 h: the name used again
    now = time.time()
    fresh = aws_cluster(isolated, "fresh", now - 3 * H, now - H)
    return {"first": first, "b": b, "second": second, "fresh": fresh, "fresh_day": day(now - 3 * H)}


def the_bill(history):
    ebs = 100 * 0.08 / 730  # the root volume an hour
    return [
        day_result(day(at(5, 10)), {("a", COMPUTE): 2 * 1.006, ("a", OTHER): 2 * ebs}),
        # b: EBS snapshots gpuctl did not count
        day_result(day(at(4, 10)), {("b", COMPUTE): 1.006, ("b", OTHER): ebs + 0.40, ("", S3): 0.30}),
        # the second `a`: data transfer out gpuctl did not count
        day_result(day(at(3, 10)), {("a", COMPUTE): 4 * 1.006, ("a", OTHER): 4 * ebs, ("a", TRANSFER): 0.90}),
        day_result(history["fresh_day"], {("fresh", COMPUTE): 0.50}, estimated=True),
    ]


def test_billed_beside_the_estimate_cached_and_lag_marked(gpuctl, aws, moto_server, tags_active, monkeypatch,
                                                          history):
    asked = ce_requests(monkeypatch)
    queue_bill(moto_server, {"ResultsByTime": the_bill(history)})
    report = json.loads(gpuctl("cost", "--billed", "--since", day(at(6, 0)), "--json").stdout)
    assert report["requests"] == 1 and len(asked) == 1
    (request,) = asked
    assert request["Granularity"] == "DAILY" and request["Metrics"] == ["UnblendedCost"]
    assert request["GroupBy"] == [{"Type": "TAG", "Key": "gpuctl:cluster"}, {"Type": "DIMENSION", "Key": "SERVICE"}]
    assert request["TimePeriod"]["Start"] == day(at(6, 0))
    rows = {c["cluster_id"]: c for c in report["clusters"]}
    # The name used twice: each cluster its own day's bill, never summed with its namesake.
    first, second = rows[history["first"]], rows[history["second"]]
    assert first["billed_usd"] == pytest.approx(2 * 1.006 + 2 * 100 * 0.08 / 730)
    assert abs(first["diff_pct"]) < 1 and first["drift"] is None
    assert second["billed_usd"] == pytest.approx(4 * 1.006 + 4 * 100 * 0.08 / 730 + 0.90)
    assert second["diff_usd"] == pytest.approx(0.90, abs=0.01) and "data transfer" in second["drift"]
    assert "EBS" in rows[history["b"]]["drift"]
    assert rows[history["b"]]["diff_usd"] == pytest.approx(0.40, abs=0.01)
    fresh = rows[history["fresh"]]
    assert fresh["not_billed_yet"] and fresh["drift"] is None  # AWS's data lags up to a day: no verdict
    assert [d["day"] for d in first["days"]] == [day(at(5, 10))]
    assert report["no_cluster_usd"] == pytest.approx(0.30)  # gpuctl's, on no cluster (a data set in S3)

    out = gpuctl("cost", "--billed", "--since", day(at(6, 0)))
    assert len(asked) == 1, "a second look asks Cost Explorer nothing: the answer is cached"
    assert "0 Cost Explorer requests" in out.stdout and "not billed yet" in out.stdout
    assert "data transfer" in out.stdout and "EBS" in out.stdout

    queue_bill(moto_server, {"ResultsByTime": the_bill(history)[-1:]})
    again = json.loads(gpuctl("cost", "--billed", "--since", day(at(6, 0)), "--refresh", "--json").stdout)
    assert again["requests"] == 1 and len(asked) == 2
    # --refresh asks again only from the first day not settled: finished days are never asked again.
    assert asked[1]["TimePeriod"]["Start"] > day(at(3, 10))

    # gpuctl's own estimate learns what it did not count: a line of its own in `cost`.
    plain = gpuctl("cost").stdout
    assert "Billed beyond gpuctl's estimate" in plain and "data transfer" in plain
    assert len(asked) == 2  # `cost` itself asks nothing


def test_a_cluster_older_than_since_shows_no_difference(gpuctl, aws, moto_server, tags_active, isolated):
    """Its bill counts from --since, gpuctl's estimate its whole life: no difference, no drift."""
    long = aws_cluster(isolated, "long", at(8, 10), at(4, 10))
    queue_bill(moto_server, {"ResultsByTime": [
        day_result(day(at(6, 0)), {("long", COMPUTE): 24 * 1.006}),
        day_result(day(at(5, 0)), {("long", COMPUTE): 24 * 1.006}),
        day_result(day(at(4, 0)), {("long", COMPUTE): 10 * 1.006})]})
    report = json.loads(gpuctl("cost", "--billed", "--since", day(at(6, 0)), "--json").stdout)
    (row,) = [c for c in report["clusters"] if c["cluster_id"] == long]
    assert row["from_since"] and row["billed_usd"] == pytest.approx(58 * 1.006)
    assert row["estimate_usd"] == pytest.approx(96 * 1.006 + 96 * 100 * 0.08 / 730, abs=0.01)  # its whole life
    assert row["diff_usd"] is None and row["diff_pct"] is None and row["drift"] is None
    assert [(p["part"], p["estimate_usd"]) for p in row["parts"]] == [("EC2 compute", None)]
    table = gpuctl("cost", "--billed", "--since", day(at(6, 0))).stdout
    (line,) = [line for line in table.splitlines() if line.startswith("long")]
    assert line.split()[5:8] == ["-", "-", "bill"], line  # long #1  DAYS  BILLED  GPUCTL  diff  diff %


def test_a_cluster_is_not_billed_yet_until_its_last_day_settles(isolated):
    """Ended at 23:00, looked at a day and a half hour later: that day is not settled, so no
    verdict (the bill below it may still grow); once it settles, the verdict comes."""
    from gpuctl.ops import billing
    from gpuctl.ops.session import open_session

    late = aws_cluster(isolated, "late", at(3, 20), at(3, 23))
    s = open_session()
    try:
        clusters = [c for c in s.ledger.clusters() if c.id == late]
        since = dt.date.fromisoformat(day(at(6, 0)))
        (row,) = billing.side_by_side(s, [], clusters, at(2, 23.5), since).clusters
        assert row.not_billed_yet and row.drift is None
        (row,) = billing.side_by_side(s, [], clusters, at(1, 0), since).clusters
        assert not row.not_billed_yet and row.drift is not None  # billed $0 of its ~$3: a verdict now
    finally:
        s.close()


def test_an_answer_past_its_page_bound_is_refused_and_none_of_it_kept(gpuctl, aws, moto_server, tags_active,
                                                                     monkeypatch, history, isolated):
    from gpuctl.provision.aws import billing

    monkeypatch.setattr(billing, "MAX_PAGES", 2)
    asked = ce_requests(monkeypatch)
    bill = the_bill(history)
    queue_bill(moto_server, {"ResultsByTime": bill[:1], "NextPageToken": "p2"},
               {"ResultsByTime": bill[1:2], "NextPageToken": "p3"})
    err = gpuctl("cost", "--billed", "--since", day(at(6, 0)), code=13).stderr
    assert "runs past 2 pages" in err and "none of it was kept" in err and "--since" in err
    assert len(asked) == 2 and asked[1]["NextPageToken"] == "p2"
    # Nothing kept: no day counts as asked, so the next look asks for every one of them again.
    led = Ledger(isolated)
    assert led.billed_days("0000", "9999") == {} and led.billed("0000", "9999") == []
    led.close()


def test_tags_not_activated_say_so(gpuctl, aws, moto_server, monkeypatch, history):
    cost_allocation_tags_as_aws_does(monkeypatch)  # seen, not active: the bill has no gpuctl rows
    asked = ce_requests(monkeypatch)
    err = gpuctl("cost", "--billed", "--since", day(at(6, 0)), code=13).stderr
    assert "gpuctl:cluster" in err and "not active" in err and "gpuctl aws billing setup" in err
    assert len(asked) == 1
    err = gpuctl("cost", "--billed", "--since", day(at(6, 0)), code=13).stderr
    assert len(asked) == 2, "an answer without the tags is not kept"


def test_no_permission_for_the_bill_names_the_action(gpuctl, aws, tags_active, monkeypatch, history):
    from moto.ce.responses import CostExplorerResponse

    deny(monkeypatch, CostExplorerResponse, "get_cost_and_usage", "ce:GetCostAndUsage")
    err = gpuctl("cost", "--billed", code=9).stderr
    assert "Error: not allowed to call ce:GetCostAndUsage" in err


@pytest.mark.parametrize(("args", "said"), [
    (["--billed", "--since", "2026-13-01"], "--since"),
    (["--billed", "--since", "yesterday"], "--since"),
    (["--billed", "--since", "2999-01-01"], "future"),
    (["--since", "2026-01-01"], "--billed"),
    (["--refresh"], "--billed"),
])
def test_bad_since(gpuctl, args, said):
    err = gpuctl("cost", *args, code=2).stderr
    assert said in err


def test_namesakes_on_one_day_split_it_by_their_hours(gpuctl, aws, moto_server, tags_active, isolated):
    first = aws_cluster(isolated, "c", at(8, 8), at(8, 9))  # 1 h
    second = aws_cluster(isolated, "c", at(8, 12), at(8, 15))  # 3 h, the same day
    queue_bill(moto_server, {"ResultsByTime": [day_result(day(at(8, 8)), {("c", COMPUTE): 4 * 1.006})]})
    report = json.loads(gpuctl("cost", "--billed", "--since", day(at(9, 0)), "--json").stdout)
    rows = {c["cluster_id"]: c for c in report["clusters"]}
    # Each lived from its `up` (a minute before its instance) to its `down`: 61 and 181 minutes.
    share = 4 * 1.006 * 61 / (61 + 181)
    assert rows[first]["billed_usd"] == pytest.approx(share) and rows[second]["billed_usd"] == pytest.approx(4 * 1.006 - share)
    assert rows[first]["days"] == [{"day": day(at(8, 8)), "usd": pytest.approx(share), "estimated": False, "shared": True}]
    assert report["other_usd"] == 0
