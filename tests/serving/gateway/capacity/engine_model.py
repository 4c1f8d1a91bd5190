"""A synthetic engine for the control law's simulations: latency grows with the requests in it.

Per window of one replica:
- the gateway lets `min(capacity, demand)` requests in; after a cut the engine still holds the
  requests admitted before, and they drain at half per window (each request lasts two windows);
- TTFT = 20 ms + 8 ms per 1,000 prompt tokens per request in flight (prefill shares each step
  with every other request: the engine's queue), ITL = 10 ms + 0.5 ms per request in flight;
- each sample is that mean times lognormal noise (sigma 0.15, p90 about 1.21 x the mean); a
  window yields in_flight / 2 TTFTs (requests starting) and 20 ITLs per request.

With the TTFT target at 400 ms p90, 1,000-token prompts meet it up to about 38 in flight, and
10,000-token prompts up to about 3.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from serving.gateway.capacity.histogram import Histogram
from serving.gateway.capacity.law import CapacityState, Tuning, WindowCounts, initial_state, next_state, summarize
from serving.gateway.config.capacity_policy import ModelCapacity

NOISE_SIGMA = 0.15
P90_OVER_MEAN = math.exp(1.2816 * NOISE_SIGMA)


def mean_ttft_ms(in_flight: int, prompt_tokens: int) -> float:
    return 20 + 8 * prompt_tokens / 1000 * in_flight


def mean_itl_ms(in_flight: int) -> float:
    return 10 + 0.5 * in_flight


def true_p90_ttft_ms(in_flight: int, prompt_tokens: int) -> float:
    return mean_ttft_ms(in_flight, prompt_tokens) * P90_OVER_MEAN


def most_in_flight_within(target_ms: float, prompt_tokens: int) -> float:
    """The most requests in flight whose true p90 TTFT meets `target_ms`."""
    return (target_ms / P90_OVER_MEAN - 20) / (8 * prompt_tokens / 1000)


@dataclass(frozen=True)
class Window:
    index: int
    prompt_tokens: int
    capacity: int  # in force during the window
    in_flight: int
    state_after: CapacityState


def simulate(
    model: ModelCapacity, prompt_tokens: list[int], *, seed: int, demand: int = 80, tuning: Tuning = Tuning()
) -> list[Window]:
    """One window per entry of `prompt_tokens` (the prompt length during that window)."""
    rng = random.Random(seed)
    state = initial_state(model)
    in_flight = 0
    recent: dict[int, WindowCounts] = {}
    trace = []
    for index, prompt in enumerate(prompt_tokens):
        admitted = min(state.slots, demand)
        in_flight = admitted if admitted >= in_flight else max(admitted, math.floor(in_flight / 2))
        ttft, itl = Histogram(), Histogram()
        ttft.extend(
            mean_ttft_ms(in_flight, prompt) * rng.lognormvariate(0, NOISE_SIGMA) for _ in range(max(1, in_flight // 2))
        )
        itl.extend(mean_itl_ms(in_flight) * rng.lognormvariate(0, NOISE_SIGMA) for _ in range(20 * in_flight))
        recent[index] = WindowCounts(ttft.counts, itl.counts, in_flight)
        recent.pop(index - tuning.max_windows, None)
        before = state
        state = next_state(state, index, summarize(state, index, recent, model, tuning), model, tuning)
        trace.append(Window(index, prompt, before.slots, in_flight, state))
    return trace


def figures(seeds: tuple[int, ...] = (1, 2, 3, 7, 11, 13, 17, 19)) -> list[str]:
    """The simulation's figures: 60 windows of 1,000-token prompts, 60 of 10,000, 60 of 1,000 again,
    against a 400 ms p90 TTFT / 50 ms p90 ITL target, capacity 2..64."""
    model = ModelCapacity(ttft_ms=400, itl_ms=50, percentile=90, min_slots=2, max_slots=64)
    lines = [
        f"knee (most in flight within target): {most_in_flight_within(400, 1000):.1f} at 1,000-token prompts, "
        f"{most_in_flight_within(400, 10_000):.1f} at 10,000"
    ]
    for seed in seeds:
        trace = simulate(model, [1000] * 60 + [10_000] * 60 + [1000] * 60, seed=seed)
        band = [w.capacity for w in trace[20:60]]
        fell = (
            next(
                w.index
                for w in trace[60:]
                if true_p90_ttft_ms(w.in_flight, 10_000) <= 400 or w.capacity == model.min_slots
            )
            - 60
        )
        long_band = [w.capacity for w in trace[60 + fell : 120]]
        back = next(w.index for w in trace[120:] if w.capacity >= min(band)) - 120
        late = [w.capacity for w in trace[120 + back :]]
        lines.append(
            f"seed {seed}: settled {min(band)}-{max(band)} ({sum(a != b for a, b in zip(band, band[1:]))} "
            f"moves in 40 windows); 10x prompts: within target after {fell} windows, then "
            f"{min(long_band)}-{max(long_band)}; back in the band {back} windows after they shrink, "
            f"then {min(late)}-{max(late)}"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(figures()))
