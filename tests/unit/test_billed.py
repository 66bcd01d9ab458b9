"""`cost --billed`'s pure rules (ops/billing.py): which days Cost Explorer is asked again (each
request costs $0.01), and which part a drift is named by."""

from __future__ import annotations

import datetime as dt

from gpuctl.ops import billing

DAY = 86400.0


def midnight(day: str) -> float:
    return dt.datetime.combine(dt.date.fromisoformat(day), dt.time(), dt.timezone.utc).timestamp()


def test_a_day_settles_a_day_after_it_ends():
    end = midnight("2026-11-11")
    assert not billing.settled("2026-11-10", end + DAY - 1)
    assert billing.settled("2026-11-10", end + DAY)


def test_a_cluster_is_not_billed_yet_until_its_last_day_settles():
    ended = midnight("2026-11-10") + 23 * 3600  # 23:00 on its last day
    assert billing.not_billed_yet(ended, ended + DAY + 1800)  # a day and a half hour later: 11-10 not settled
    assert not billing.not_billed_yet(ended, midnight("2026-11-12"))


def test_a_settled_day_is_never_asked_again_a_recent_one_after_a_while_or_on_refresh():
    now = midnight("2026-11-12") + 3600  # 11-10 settled, 11-11 and 11-12 not
    days = ["2026-11-09", "2026-11-10", "2026-11-11", "2026-11-12"]
    kept = {d: now - 60 for d in days[:3]}
    assert billing.to_ask(days, kept, now, refresh=False) == ["2026-11-12"]  # never asked
    assert billing.to_ask(days, kept, now, refresh=True) == ["2026-11-11", "2026-11-12"]
    old = {d: now - billing.REASK_S for d in days}
    assert billing.to_ask(days, old, now, refresh=False) == ["2026-11-11", "2026-11-12"]
    assert billing.to_ask(days[:2], {d: 0.0 for d in days}, now, refresh=True) == []


def test_the_drift_names_the_part_furthest_from_what_gpuctl_counted():
    counted = {"EC2 compute": 2.0, "EBS": 0.02}
    assert billing._which_part({"EC2 compute": 2.0, "EBS": 0.02, "data transfer": 0.9}, counted) == \
        "data transfer $0.90, not counted by gpuctl"
    assert billing._which_part({"EC2 compute": 2.0, "EBS": 0.42}, counted) == "EBS: billed $0.42, gpuctl counted $0.02"
    assert billing._which_part({"EC2 compute": 1.0, "EBS": 0.02}, counted).startswith("EC2 compute: billed $1.00")
