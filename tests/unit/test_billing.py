"""Exact dollars for constructed timelines: each billing rule on its own, then together."""

import pytest

from gpuctl.model import billing

H = 3600.0


def test_sixty_second_minimum_per_running_period():
    assert billing.billed_seconds(0, 10) == 60
    assert billing.billed_seconds(0, 61.5) == 61.5
    assert billing.compute_cost([(0, 10)], [(0, 3.6)]) == pytest.approx(0.06)  # 60 s at $3.6/h
    assert billing.compute_cost([(0, 120)], [(0, 3.6)]) == pytest.approx(0.12)


def test_stop_and_restart_are_two_periods_each_with_its_minimum():
    # 30 s running, stopped for an hour (no compute), 90 s running again.
    periods = [(0, 30), (30 + H, 30 + H + 90)]
    assert billing.compute_cost(periods, [(0, 3.6)]) == pytest.approx((60 + 90) * 0.001)


def test_spot_price_change_mid_run_is_integrated_piecewise():
    steps = [(-100, 0.40), (1800, 0.60), (5400, 0.30)]  # $/h, changing at 30 min and 90 min
    usd = billing.compute_cost([(0, 2 * H)], steps)
    assert usd == pytest.approx(0.5 * 0.40 + 1.0 * 0.60 + 0.5 * 0.30)
    assert billing.price_at(1799, steps) == 0.40 and billing.price_at(1800, steps) == 0.60
    # A period starting before the first known price uses the first price.
    assert billing.integrate(-200, -100, [(0, 1.0)]) == pytest.approx(100 / H)


def test_storage_only_period_is_prorated_per_gb_month():
    # 100 GB gp3 for a whole 730-hour month: $8.00; for one day: 8 * 24 / 730.
    assert billing.storage_cost(100, 0, 730 * H) == pytest.approx(8.0)
    assert billing.storage_cost(100, 0, 24 * H) == pytest.approx(8.0 * 24 / 730)
    assert billing.storage_cost(100, 5, 5) == 0


def test_an_instance_ended_by_a_guard_pays_until_then_and_not_after():
    launched, guard_fired = 1000.0, 1000.0 + 2.5 * H
    compute = billing.compute_cost([(launched, guard_fired)], [(0, 1.006)])
    storage = billing.storage_cost(100, launched, guard_fired)
    assert compute == pytest.approx(2.5 * 1.006)
    assert storage == pytest.approx(100 * 0.08 * 2.5 / 730)


# Each edge the rules above leave between their examples (found by scripts/mutate: a < for a <=,
# a 0 for a 1 there went unnoticed).
@pytest.mark.parametrize("start, end, billed", [
    (5, 5, 60),  # a period that started and ended at once still pays its minute
    (10, 5, 0),  # an end before the start (a clock set back) bills nothing, not a minute
    (0, 60, 60),
    (0, 60.5, 60.5),
])
def test_billed_seconds_at_the_edges(start, end, billed):
    assert billing.billed_seconds(start, end) == billed


@pytest.mark.parametrize("start, end, steps, usd", [
    (10, 5, [(0, 3.6)], 0.0),  # backwards: nothing, never a negative (a refund)
    (5, 5, [(0, 3.6)], 0.0),
    (0, H, [], 0.0),  # no price known: nothing here (the callers always pass one)
    (0, H, [(0, 1.0)], 1.0),
])
def test_integrate_at_the_edges(start, end, steps, usd):
    assert billing.integrate(start, end, steps) == pytest.approx(usd)


def test_no_price_steps_price_nothing():
    assert billing.price_at(5, []) == 0.0


def test_an_interruption_at_exactly_one_hour_is_billed():
    """EC2 bills nothing only within the first hour: at 3600 s the hour is used."""
    assert not billing.interruption_is_free("spot", billing.SPOT_INTERRUPTION_REASON, 0.0, 3600.0)
    assert billing.interruption_is_free("spot", billing.SPOT_INTERRUPTION_REASON, 0.0, 3599.9)
