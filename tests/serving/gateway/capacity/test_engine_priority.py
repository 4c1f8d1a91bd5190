"""The engine priority: the tier order first, then under its share before over it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.capacity.engine_priority import SHARE_BANDS, engine_priority, share_band, unknown_share_priority
from tests.support.hypothesis import examples


def test_under_its_share_goes_ahead_of_over_it_within_a_tier():
    # 64 slots, 4 tenants holding: a share is 16.
    light = engine_priority(1, held=3, capacity=64, holders=4)
    even = engine_priority(1, held=16, capacity=64, holders=4)
    heavy = engine_priority(1, held=48, capacity=64, holders=4)
    assert light < even < heavy
    assert (light, even, heavy) == (1 * SHARE_BANDS, 1 * SHARE_BANDS + 1, 1 * SHARE_BANDS + 2)


def test_the_tier_order_comes_first():
    # The heaviest tenant of the first tier still goes before the lightest of the next.
    assert engine_priority(0, held=64, capacity=64, holders=1) < engine_priority(1, held=1, capacity=64, holders=9)


def test_weights_split_the_share():
    # 8 slots, tenants weighing 3, 1 and 1 hold slots: shares 4.8 (capped at half: 4), 1.6, 1.6.
    assert share_band(3, 8, 3, weight=3, weights=5) == 0
    assert share_band(4, 8, 3, weight=3, weights=5) == 1
    assert share_band(1, 8, 3, weight=1, weights=5) == 0
    assert share_band(2, 8, 3, weight=1, weights=5) == 1
    assert share_band(4, 8, 3, weight=1, weights=5) == 2
    # Equal weights are the unweighted rule (the fair queue's reserve).
    assert all(share_band(h, 64, 4, weight=2, weights=8) == share_band(h, 64, 4) for h in range(70))


def test_a_tenant_alone_holds_no_more_than_half_before_it_counts_as_over():
    # As the fair queue's reserve rule: the share is never more than half of the capacity.
    assert share_band(31, 64, 1) == 0
    assert share_band(32, 64, 1) == 1
    assert share_band(64, 64, 1) == 2
    assert share_band(31, 64, 1, weight=5, weights=5) == 0 and share_band(32, 64, 1, weight=5, weights=5) == 1


def test_an_unknown_share_gets_its_tiers_last_band():
    assert unknown_share_priority(1) == 2 * SHARE_BANDS - 1
    assert engine_priority(1, held=10_000, capacity=1, holders=1) == unknown_share_priority(1)
    assert unknown_share_priority(1) < engine_priority(2, held=0, capacity=1, holders=1)


@settings(max_examples=examples(fast=300, deep=5000), deadline=None)
@given(
    rank=st.integers(0, 8),
    held=st.integers(0, 10_000),
    capacity=st.integers(0, 10_000),
    holders=st.integers(0, 1000),
    more=st.integers(0, 10_000),
    weight=st.floats(0.01, 100),
    others=st.floats(0, 10_000),
    heavier=st.floats(0, 100),
)
def test_priority_orders_by_tier_then_by_what_the_tenant_holds(
    rank, held, capacity, holders, more, weight, others, heavier
):
    weights = weight + others
    priority = engine_priority(rank, held, capacity, holders, weight=weight, weights=weights)
    assert rank * SHARE_BANDS <= priority < (rank + 1) * SHARE_BANDS
    # Holding more never goes first; weighing more (the others unchanged) never goes later.
    assert engine_priority(rank, held + more, capacity, holders, weight=weight, weights=weights) >= priority
    weightier = engine_priority(rank, held, capacity, holders, weight=weight + heavier, weights=weights + heavier)
    assert weightier <= priority
    assert priority < engine_priority(rank + 1, 0, capacity, holders)
