"""The dashboard's spend in calendar windows (ops/dashboard.spend, a pure function): periods cut
at each window's start, price steps followed, ended instances counted to their end."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuctl.model.records import InstanceRecord
from gpuctl.ops.dashboard import spend, windows


def _inst(start: float, end: float | None, usd: float = 3.6, **kw) -> InstanceRecord:
    return InstanceRecord(id="i", cluster="c", state="running" if end is None else "terminated", usd_per_hour=usd,
                          launched_at=start, terminated_at=end, workdir="/w", **kw)


def test_windows_are_today_monday_and_the_first_in_local_time():
    now = dt.datetime(2026, 12, 5, 15, 30).timestamp()  # a Saturday
    today, week, month = windows(now)
    assert dt.datetime.fromtimestamp(today) == dt.datetime(2026, 12, 5)
    assert dt.datetime.fromtimestamp(week) == dt.datetime(2026, 11, 30)
    assert dt.datetime.fromtimestamp(month) == dt.datetime(2026, 12, 1)


def test_an_instance_across_midnight_counts_its_hours_in_each_window():
    midnight = dt.datetime(2026, 12, 5).timestamp()
    now = midnight + 2 * 3600
    s = spend([_inst(midnight - 3 * 3600, None)], now)  # 3 h yesterday, 2 h today, at $3.60/h
    assert s.today_usd == pytest.approx(7.2) and s.week_usd == pytest.approx(18.0) and s.month_usd == pytest.approx(18.0)


def test_price_steps_stopped_periods_and_ended_instances():
    midnight = dt.datetime(2026, 12, 5).timestamp()
    now = midnight + 10 * 3600
    spot = _inst(midnight, None, usd=1.0, price_steps=((midnight, 1.0), (midnight + 3600, 2.0)),
                 periods=((midnight, midnight + 2 * 3600), (midnight + 5 * 3600, None)))
    ended = _inst(midnight + 3600, midnight + 1800 + 3600, usd=3.6)
    s = spend([spot, ended], now)
    # spot: 1 h at $1 + 1 h at $2, stopped, then 5 h at $2; ended: half an hour at $3.60.
    assert s.today_usd == pytest.approx(1 + 2 + 10 + 1.8)
    assert spend([], now).today_usd == 0.0
