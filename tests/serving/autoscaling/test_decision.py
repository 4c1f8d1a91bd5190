"""The saturation decision: each signal alone scales up, all quiet scales down, bounds hold
both ways, and a steady load never flaps (decision.decide is pure: called directly)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from serving.autoscaling.decision import (
    Replicas,
    SaturationThresholds,
    Signals,
    Why,
    decide,
    expected_wait_s,
)
from tests.support.hypothesis import examples

T = SaturationThresholds()  # engine 1/replica, KV 0.9 / 0.5, queue 4/replica, wait 2 s, cooldown 60 s
QUIET = Signals(ongoing=0.0, engine_waiting=0.0, kv_cache_use=0.0, queue_depth=0.0, queue_wait_s=0.0)


def replicas(running: int, target: int | None = None, lo: int = 1, hi: int = 4, per_replica: float = 16):
    return Replicas(
        running=running,
        target=running if target is None else target,
        min=lo,
        max=hi,
        target_ongoing_requests=per_replica,
    )


def with_(**fields) -> Signals:
    return Signals(**{**QUIET.__dict__, **fields})


@pytest.mark.parametrize(
    ("signals", "why"),
    [
        (with_(ongoing=2, engine_waiting=2.0), Why.ENGINE_WAITING),  # 1 per replica at 2 replicas
        (with_(ongoing=2, kv_cache_use=0.9), Why.KV_CACHE),
        (with_(ongoing=2, queue_depth=8.0), Why.QUEUE_DEPTH),  # 4 per replica at 2 replicas
        (with_(ongoing=2, queue_depth=1.0, queue_wait_s=2.0), Why.QUEUE_WAIT),
    ],
)
def test_each_signal_alone_adds_one_replica(signals, why):
    decision = decide(signals, replicas(2), T, now=1000, last_change=None)
    assert (decision.replicas, decision.why) == (3, why)


@pytest.mark.parametrize(
    "signals",
    [
        with_(ongoing=2, engine_waiting=1.9),
        with_(ongoing=2, kv_cache_use=0.89),
        with_(ongoing=2, queue_depth=7.0),
        with_(ongoing=2, queue_wait_s=1.99),
    ],
)
def test_each_signal_just_under_its_threshold_adds_none(signals):
    # Under the threshold but not quiet either: neither direction.
    assert decide(signals, replicas(2), T, now=1000, last_change=None).replicas == 2


def test_all_quiet_removes_one_replica():
    decision = decide(with_(ongoing=3, kv_cache_use=0.2), replicas(3), T, now=1000, last_change=None)
    assert (decision.replicas, decision.why) == (2, Why.QUIET)


@pytest.mark.parametrize(
    "busy",
    [
        with_(ongoing=3, engine_waiting=0.5),  # anything waiting in the engine
        with_(ongoing=3, queue_depth=1.0),  # anyone in the gateway's queue
        with_(ongoing=3, queue_wait_s=0.1),
        with_(ongoing=3, kv_cache_use=0.34),  # 0.34 * 3 / 2 = 0.51: over kv_cache_low on one replica fewer
        with_(ongoing=33.0),  # 33 / 2 replicas over the 16 each the stack aims for
        with_(ongoing=3, engine_waiting=None),  # unknown is not quiet
        with_(ongoing=3, kv_cache_use=None),
        with_(ongoing=3, queue_depth=None),
    ],
)
def test_one_busy_or_unknown_signal_keeps_every_replica(busy):
    assert decide(busy, replicas(3), T, now=1000, last_change=None).replicas == 3


def test_hysteresis_gap_between_the_kv_thresholds():
    # 0.33 on 3 replicas is 0.495 on 2: under kv_cache_low, down. 0.34 is 0.51: stays (above).
    assert decide(with_(ongoing=3, kv_cache_use=0.33), replicas(3), T, now=1000, last_change=None).replicas == 2


def test_a_replica_still_starting_is_not_asked_for_twice():
    # Serve already aims for 3 while the third loads its weights: the same saturation keeps 3.
    decision = decide(with_(ongoing=2, kv_cache_use=0.95), replicas(2, target=3), T, now=1000, last_change=None)
    assert decision.replicas == 3


def test_cooldown_holds_then_lets_go():
    saturated = with_(ongoing=2, kv_cache_use=0.95)
    held = decide(saturated, replicas(2), T, now=1000, last_change=1000 - T.cooldown_s + 1)
    assert (held.replicas, held.why) == (2, Why.COOLDOWN)
    assert decide(saturated, replicas(2), T, now=1000, last_change=1000 - T.cooldown_s).replicas == 3


def test_bounds_on_both_sides():
    assert decide(with_(ongoing=9, kv_cache_use=1.0), replicas(4), T, now=1000, last_change=None).replicas == 4
    assert decide(QUIET, replicas(1), T, now=1000, last_change=None).replicas == 1


def test_to_zero_only_when_nothing_is_asked_and_back_when_something_is():
    assert decide(QUIET, replicas(1, lo=0), T, now=1000, last_change=None).replicas == 0
    assert decide(with_(ongoing=1), replicas(1, lo=0), T, now=1000, last_change=None).replicas == 1
    cold = decide(Signals(0, None, None, 2.0, None), replicas(0, lo=0), T, now=1000, last_change=None)
    assert (cold.replicas, cold.why) == (1, Why.COLD_START)
    assert decide(Signals(0, None, None, 0.0, None), replicas(0, lo=0), T, now=1000, last_change=None).replicas == 0


def test_thresholds_refuse_a_low_mark_at_or_over_the_high_one():
    with pytest.raises(ValidationError, match="kv_cache_low"):
        SaturationThresholds(kv_cache_low=0.9, kv_cache_high=0.9)
    SaturationThresholds(kv_cache_low=0.89, kv_cache_high=0.9)


def test_expected_wait_is_littles_law_on_the_queue_figures():
    assert expected_wait_s(8, 0.5, 4) == 1.0
    assert expected_wait_s(0, 0.5, 4) == 0.0
    assert expected_wait_s(8, None, 4) is None


# --- properties -----------------------------------------------------------------------------

maybe = st.none() | st.floats(min_value=0, max_value=200, allow_nan=False)
signals_ = st.builds(
    Signals,
    st.floats(min_value=0, max_value=500, allow_nan=False),
    maybe,
    st.none() | st.floats(min_value=0, max_value=1, allow_nan=False),
    maybe,
    maybe,
)


@st.composite
def bounds(draw):
    lo = draw(st.integers(min_value=0, max_value=5))
    hi = draw(st.integers(min_value=max(1, lo), max_value=8))
    running = draw(st.integers(min_value=0, max_value=10))
    target = draw(st.integers(min_value=running, max_value=10))
    return Replicas(running=running, target=target, min=lo, max=hi, target_ongoing_requests=16)


@settings(max_examples=examples(fast=300, deep=5000))
@given(signals_, bounds(), st.none() | st.floats(min_value=0, max_value=2000))
def test_the_decision_stays_within_bounds(signals, bounds_, last_change):
    assert bounds_.min <= decide(signals, bounds_, T, now=1000, last_change=last_change).replicas <= bounds_.max


def run(load, start: int, lo: int, hi: int, ticks: int = 200, tick_s: float = 15.0) -> list[int]:
    """Serve's loop, simplified: every tick the policy decides, the replica count follows at once,
    and a change restarts the cooldown. `load(n)`: the signals with n replicas serving."""
    n, last_change, trace = start, None, [start]
    for tick in range(ticks):
        now = tick * tick_s
        wanted = decide(load(n), Replicas(n, n, lo, hi, 16), T, now=now, last_change=last_change).replicas
        if wanted != n:
            n, last_change = wanted, now
        trace.append(n)
    return trace


def changes(trace: list[int]) -> list[int]:
    return [b - a for a, b in zip(trace, trace[1:]) if b != a]


@settings(max_examples=examples(fast=200, deep=3000))
@given(signals_, st.integers(min_value=1, max_value=6), st.integers(min_value=1, max_value=8))
def test_constant_signals_never_flap(signals, start, hi):
    trace = run(lambda n: signals, min(start, hi), 1, hi)
    steps = changes(trace)
    assert all(s > 0 for s in steps) or all(s < 0 for s in steps), trace
    assert trace[-1] == trace[-2], trace  # settled


@settings(max_examples=examples(fast=200, deep=3000))
@given(
    st.floats(min_value=0, max_value=8, allow_nan=False),
    st.floats(min_value=0, max_value=40, allow_nan=False),
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=1, max_value=8),
)
def test_a_steady_load_spread_over_the_replicas_never_flaps(kv_total, ongoing, start, hi):
    # The load splits over the replicas: KV use per replica is the total over n. A scale-up
    # (KV over 0.9 on n) cannot be followed by a scale-down (needs under 0.5 on n), nor the reverse.
    def load(n):
        return with_(ongoing=ongoing, kv_cache_use=min(1.0, kv_total / max(1, n)))

    trace = run(load, min(start, hi), 1, hi)
    steps = changes(trace)
    assert all(s > 0 for s in steps) or all(s < 0 for s in steps), trace
    assert trace[-1] == trace[-2], trace
