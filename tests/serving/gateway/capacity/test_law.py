"""The capacity control law (serving.gateway.capacity.law): against a synthetic engine whose
latency grows with its load it settles in a band and stays there, falls when prompts grow
tenfold and comes back when they shrink; and whatever it measures, it never leaves [floor,
ceiling] and moves by bounded steps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.capacity.histogram import bucket_of
from serving.gateway.capacity.law import (
    CapacityState,
    Move,
    Tuning,
    WindowCounts,
    WindowSummary,
    initial_state,
    next_state,
    summarize,
)
from serving.gateway.config.capacity_policy import ModelCapacity
from tests.serving.gateway.capacity.engine_model import most_in_flight_within, simulate, true_p90_ttft_ms
from tests.support.hypothesis import examples

MODEL = ModelCapacity(ttft_ms=400, itl_ms=50, percentile=90, min_slots=2, max_slots=64)
SHORT, LONG = 1000, 10_000
SEEDS = [1, 2, 3, 7, 11]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_capacity_settles_in_a_band_and_stays_there(seed):
    trace = simulate(MODEL, [SHORT] * 80, seed=seed)
    settled = [w.capacity for w in trace[20:]]
    knee = most_in_flight_within(MODEL.ttft_ms, SHORT)  # about 38
    # Both sides of the band: at or under where the target is met, and not starved far below it.
    assert max(settled) <= math.floor(knee)
    assert min(settled) >= 0.65 * knee
    assert max(settled) - min(settled) <= 2 * Tuning().step(max(settled), MODEL.max_slots)
    # No saw-tooth: a few noise-driven moves in 60 windows, not one every few windows.
    changes = sum(a != b for a, b in zip(settled, settled[1:]))
    assert changes <= 6
    assert all(true_p90_ttft_ms(w.in_flight, SHORT) <= MODEL.ttft_ms for w in trace[20:])


@pytest.mark.parametrize("seed", SEEDS)
def test_tenfold_prompts_cut_the_capacity_and_shorter_ones_bring_it_back(seed):
    prompts = [SHORT] * 60 + [LONG] * 60 + [SHORT] * 60
    trace = simulate(MODEL, prompts, seed=seed)
    before = [w.capacity for w in trace[30:60]]
    # Falls: within 10 windows the engine meets the target again (or the floor is reached), and
    # stays within it while the prompts stay long.
    met = next(
        w.index
        for w in trace[60:]
        if true_p90_ttft_ms(w.in_flight, LONG) <= MODEL.ttft_ms or w.capacity == MODEL.min_slots
    )
    assert met - 60 <= 10
    long_run = trace[met:120]
    assert all(w.capacity <= math.ceil(most_in_flight_within(MODEL.ttft_ms, LONG)) + 1 for w in long_run)
    assert all(w.capacity >= MODEL.min_slots for w in long_run)
    # Recovers: back in the band it had before, and within target there.
    back = next(w.index for w in trace[120:] if w.capacity >= min(before))
    assert back - 120 <= 35  # slow at first: 2-3 requests in flight start one TTFT sample a window
    assert all(true_p90_ttft_ms(w.in_flight, SHORT) <= MODEL.ttft_ms for w in trace[back:])
    assert max(w.capacity for w in trace[back:]) <= math.floor(most_in_flight_within(MODEL.ttft_ms, SHORT))


def test_with_adaptation_off_the_capacity_is_the_ceiling_whatever_the_latency():
    fixed = MODEL.model_copy(update={"adaptive": False})
    trace = simulate(fixed, [LONG] * 20, seed=1)
    assert {w.capacity for w in trace} == {fixed.max_slots}
    assert trace[-1].state_after.move is Move.FIXED


def summary(ttft=None, itl=None, peak=64.0):
    return WindowSummary(ttft_ms=ttft, itl_ms=itl, peak_in_flight=peak)


def test_over_target_cuts_from_what_was_in_flight_by_the_overshoot_within_bounds():
    state = CapacityState(slots=64)
    # Twice the target: half of the 40 in flight (the deepest cut allowed).
    assert next_state(state, 5, summary(ttft=800, itl=10, peak=40), MODEL).slots == 20
    # Four times: still half, never deeper in one step.
    assert next_state(state, 5, summary(ttft=1600, itl=10, peak=40), MODEL).slots == 20
    # Just over: the shallowest cut, 0.9, and at least one slot.
    assert next_state(state, 5, summary(ttft=10, itl=51, peak=64), MODEL).slots == 57
    assert next_state(CapacityState(slots=3), 5, summary(ttft=401, itl=10, peak=3), MODEL).slots == 2
    # Never below the floor.
    assert next_state(CapacityState(slots=2), 5, summary(ttft=4000, itl=10, peak=2), MODEL).slots == 2


def test_growth_needs_both_latencies_well_within_target_and_the_capacity_in_use():
    state = CapacityState(slots=20)
    step = Tuning().step(20, MODEL.max_slots)
    assert next_state(state, 5, summary(ttft=270, itl=30, peak=20), MODEL).slots == 20 + step  # 0.675 < 0.7
    assert next_state(state, 5, summary(ttft=300, itl=30, peak=20), MODEL).move is Move.IN_BAND  # 0.75
    assert next_state(state, 5, summary(ttft=100, itl=10, peak=9), MODEL).move is Move.IDLE  # under half in use
    assert next_state(state, 5, summary(ttft=100, itl=None, peak=20), MODEL).move is Move.UNMEASURED
    assert next_state(state, 5, summary(ttft=None, itl=None, peak=20), MODEL).move is Move.UNMEASURED
    # Far below target it at most doubles, and never past the ceiling.
    assert next_state(state, 5, summary(ttft=10, itl=1, peak=20), MODEL).slots == 40
    assert next_state(CapacityState(slots=60), 5, summary(ttft=10, itl=1, peak=60), MODEL).slots == 64


def counts(ms, n):
    return {bucket_of(ms): n}


def test_only_windows_after_a_change_and_its_settling_are_read():
    state = CapacityState(slots=30, changed_window=10)
    slow, fast = WindowCounts(counts(900, 50), counts(20, 50), 30), WindowCounts(counts(100, 50), counts(20, 50), 30)
    # Window 11 settles (requests admitted under the old capacity): its slow samples do not count.
    assert summarize(state, 11, {11: slow}, MODEL).ttft_ms is None
    assert summarize(state, 12, {11: slow, 12: fast}, MODEL).ttft_ms == pytest.approx(100, rel=0.1)


def test_a_sparse_metric_reads_back_until_it_has_enough_samples_and_a_change_shows_at_once():
    windows = {w: WindowCounts(counts(100, 3), counts(20, 50), 30) for w in range(8)}
    got = summarize(CapacityState(slots=30), 7, windows, MODEL)
    assert got.ttft_ms == pytest.approx(100, rel=0.1) and got.itl_ms == pytest.approx(20, rel=0.1)
    # Too few TTFTs in all the windows it may read: none.
    assert summarize(CapacityState(slots=30), 1, {0: windows[0], 1: windows[1]}, MODEL).ttft_ms is None
    # A burst of slow requests in the newest window is read from it alone.
    windows[8] = WindowCounts(counts(900, 10), counts(20, 50), 30)
    assert summarize(CapacityState(slots=30), 8, windows, MODEL).ttft_ms == pytest.approx(900, rel=0.1)


def test_a_model_starts_at_its_ceiling():
    assert initial_state(MODEL).slots == MODEL.max_slots


latency = st.none() | st.floats(min_value=0.1, max_value=1e6, allow_nan=False)


@settings(max_examples=examples(fast=300, deep=5000), deadline=None)
@given(
    low=st.integers(1, 64),
    span=st.integers(0, 256),
    slots=st.integers(-10, 400),
    ttft=latency,
    itl=latency,
    peak=st.floats(min_value=0, max_value=1000, allow_nan=False),
    adaptive=st.booleans(),
)
def test_the_capacity_never_leaves_its_bounds_and_moves_by_bounded_steps(low, span, slots, ttft, itl, peak, adaptive):
    model = MODEL.model_copy(update={"min_slots": low, "max_slots": low + span, "adaptive": adaptive})
    tuning = Tuning()
    after = next_state(CapacityState(slots=slots), 3, summary(ttft=ttft, itl=itl, peak=peak), model, tuning)
    assert model.min_slots <= after.slots <= model.max_slots
    start = min(model.max_slots, max(model.min_slots, slots))
    if not adaptive:
        assert after.slots == model.max_slots
    elif after.slots < start:
        # A cut: from what was in flight, never deeper than the lowest backoff.
        assert after.move is Move.DOWN
        in_flight = min(start, max(peak, 1.0))
        assert after.slots >= max(model.min_slots, math.floor(in_flight * tuning.min_backoff))
    elif after.slots > start:
        assert after.move is Move.UP
        assert after.slots - start <= start  # at most doubling


@settings(max_examples=examples(fast=100, deep=1000), deadline=None)
@given(
    st.lists(
        st.tuples(latency, latency, st.floats(min_value=0, max_value=500, allow_nan=False)), min_size=1, max_size=60
    )
)
def test_any_sequence_of_windows_keeps_the_capacity_within_bounds(windows):
    state = initial_state(MODEL)
    for index, (ttft, itl, peak) in enumerate(windows):
        state = next_state(state, index, summary(ttft=ttft, itl=itl, peak=peak), MODEL)
        assert MODEL.min_slots <= state.slots <= MODEL.max_slots
