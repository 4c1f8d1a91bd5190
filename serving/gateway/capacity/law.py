"""The control law that moves a model's capacity (requests in flight per replica) to keep its
latency target: pure, one call per measurement window.

The law is AIMD with a latency target as its congestion signal, after Netflix's
concurrency-limits `AIMDLimit` (github.com/Netflix/concurrency-limits, concurrency-limits-core,
limit/AIMDLimit.java): a request slower than a timeout counts as a drop; a drop multiplies the
limit by a backoff ratio (default 0.9, accepted in [0.5, 1)); without drops the limit grows by
one, but only while at least half of it is in flight, so an idle service does not grow a limit
it never tested. AIMD itself is TCP's congestion avoidance (RFC 5681; Chiu and Jain, "Analysis
of the Increase and Decrease Algorithms for Congestion Avoidance in Computer Networks", 1989,
which shows it is the linear law that converges). Here, per window of samples from every gateway
replica:

- pressure = the larger of (TTFT percentile / TTFT target) and (ITL percentile / ITL target),
  each percentile read from the newest windows holding at least `min_samples` samples;
- pressure > 1 (over target): cut multiplicatively, from what was actually in flight (as RFC
  5681 sets the threshold from the flight size, not the window), by 1 / pressure bounded to
  AIMDLimit's backoff range [0.5, 0.9]: latency grows about linearly with the requests in the
  engine once it is saturated, so 1 / pressure lands about where the target is met, and the
  bound keeps one noisy window from cutting deeper than half;
- pressure <= `comfort` (well within target) for both latencies, and at least half the capacity
  in flight: add a step (1/16 of the ceiling, at most half the capacity, at least one), or, far below target, grow
  by comfort / pressure (TCP's slow start below its threshold); never more than doubling;
- between `comfort` and 1: hold. This dead band is what keeps the law out of the saw-tooth of
  plain AIMD, which probes upward until the next drop, forever: a capacity whose latency sits
  in the band stays where it is.
After a change, the next `settle_windows` windows measure nothing (requests admitted before the
change are still in flight, and their latencies are not the new capacity's), and no window from
before the change is read again. tests/serving/gateway/capacity/test_law.py simulates an engine
whose latency grows with its load, and shows the capacity settle in a band, fall when prompts
grow tenfold and come back when they shrink.

Envoy's adaptive concurrency filter and Netflix's Gradient2Limit instead compare the latency
with a measured baseline (minRTT) and need no target; the gateway has a target per model (the
stack's SLO), which is what users can state and check, so the signal is the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from serving.gateway.capacity.histogram import quantile_ms
from serving.gateway.config.capacity_policy import ModelCapacity


class Move(str, Enum):
    """What the last decision did to the capacity, and why (for logs, metrics and status)."""

    DOWN = "down"  # over target
    UP = "up"  # well within target, and the capacity in use
    IN_BAND = "in_band"  # within target, not by enough to add
    IDLE = "idle"  # within target but less than half the capacity in use: nothing to learn
    UNMEASURED = "unmeasured"  # too few samples since the last change
    FIXED = "fixed"  # adaptation off: the capacity is the ceiling


@dataclass(frozen=True)
class Tuning:
    """The law's constants; the defaults are what the simulation tests hold it to."""

    comfort: float = 0.7  # pressure at or below it may grow the capacity
    min_backoff: float = 0.5  # the deepest cut at once (AIMDLimit's lowest backoff ratio)
    max_backoff: float = 0.9  # the shallowest cut (AIMDLimit's default backoff ratio)
    step_fraction: float = 1 / 16  # an increase adds this share of the ceiling (at most half the capacity)
    settle_windows: int = 1  # windows right after a change that measure nothing (see next_state)
    min_samples: int = 8  # fewest samples a percentile is read from
    max_windows: int = 8  # how far back a sparse metric (few TTFTs: long requests) may look

    def step(self, slots: int, max_slots: int) -> int:
        """The additive increase: a share of the ceiling, but at most half of the capacity now, since
        at a few slots one more request is a large change in the engine's load; at least one."""
        return max(1, min(math.floor(max_slots * self.step_fraction), slots // 2))


DEFAULT_TUNING = Tuning()


@dataclass(frozen=True)
class WindowCounts:
    """One window's samples of one model, merged across every gateway replica."""

    ttft: Mapping[int, int]  # histogram bucket -> count (serving.gateway.capacity.histogram)
    itl: Mapping[int, int]
    peak_in_flight: float  # most requests in flight per replica during the window (0: idle)


@dataclass(frozen=True)
class WindowSummary:
    """What the law reads: each latency's percentile, or None where too few samples were measured."""

    ttft_ms: float | None
    itl_ms: float | None
    peak_in_flight: float


@dataclass(frozen=True)
class CapacityState:
    """A model's capacity per replica and what the law remembers between windows."""

    slots: int
    changed_window: int = -(2**62)  # the window whose decision last changed `slots`
    move: Move = Move.UNMEASURED


def initial_state(model: ModelCapacity) -> CapacityState:
    """Where a model starts: its ceiling (what Serve takes), until measurements say otherwise."""
    return CapacityState(slots=model.max_slots, move=Move.UNMEASURED if model.adaptive else Move.FIXED)


def summarize(
    state: CapacityState,
    window: int,
    recent: Mapping[int, WindowCounts],
    model: ModelCapacity,
    tuning: Tuning = DEFAULT_TUNING,
) -> WindowSummary:
    """Percentiles over the newest windows up to `window`, each metric reading back until it has
    `min_samples` (at most `max_windows`): a sudden change shows in the next window, and a sparse
    metric still gets a percentile. Only windows after the last change and its settling count:
    the requests measured before were admitted under the old capacity."""
    first = max(state.changed_window + tuning.settle_windows + 1, window - tuning.max_windows + 1)
    usable = [recent[w] for w in range(window, first - 1, -1) if w in recent]

    def read(metric: str) -> tuple[float | None, int]:
        merged: dict[int, int] = {}
        for used, counts in enumerate(usable, start=1):
            for bucket, count in getattr(counts, metric).items():
                merged[bucket] = merged.get(bucket, 0) + count
            if sum(merged.values()) >= tuning.min_samples:
                return quantile_ms(merged, model.percentile), used
        return None, len(usable)

    ttft, ttft_windows = read("ttft")
    itl, itl_windows = read("itl")
    peak = max((w.peak_in_flight for w in usable[: max(ttft_windows, itl_windows)]), default=0.0)
    return WindowSummary(ttft, itl, peak)


def pressure(summary: WindowSummary, model: ModelCapacity) -> float | None:
    """How far over target the measurements are (1: exactly at it); None: nothing measured."""
    ratios = [
        measured / target
        for measured, target in ((summary.ttft_ms, model.ttft_ms), (summary.itl_ms, model.itl_ms))
        if measured is not None
    ]
    return max(ratios) if ratios else None


def next_state(
    state: CapacityState, window: int, summary: WindowSummary, model: ModelCapacity, tuning: Tuning = DEFAULT_TUNING
) -> CapacityState:
    """The capacity after window `window` closed, always within [model.min_slots, model.max_slots].
    Either latency over target cuts; growing needs both measured and well within target."""
    low, high = model.min_slots, model.max_slots
    slots = min(high, max(low, state.slots))  # the bounds may have changed since the last window
    if not model.adaptive:
        return CapacityState(high, state.changed_window, Move.FIXED)
    over = pressure(summary, model)
    if over is None:
        return CapacityState(slots, state.changed_window, Move.UNMEASURED)
    if over > 1:
        backoff = min(tuning.max_backoff, max(tuning.min_backoff, 1 / over))
        in_flight = min(slots, max(summary.peak_in_flight, 1.0))
        cut = max(low, min(slots - 1, math.floor(in_flight * backoff)))
        return CapacityState(cut, window if cut != slots else state.changed_window, Move.DOWN)
    if summary.ttft_ms is None or summary.itl_ms is None:
        return CapacityState(slots, state.changed_window, Move.UNMEASURED)
    if over > tuning.comfort:
        return CapacityState(slots, state.changed_window, Move.IN_BAND)
    if summary.peak_in_flight * 2 < slots:
        return CapacityState(slots, state.changed_window, Move.IDLE)
    # Far below target, grow in proportion (TCP's slow start below its threshold): a capacity cut
    # for long prompts comes back in a few windows, not dozens. Never more than doubling.
    proportional = math.floor(slots * (tuning.comfort / over - 1))
    grown = min(high, slots + min(slots, max(tuning.step(slots, high), proportional)))
    return CapacityState(grown, window if grown != slots else state.changed_window, Move.UP)
