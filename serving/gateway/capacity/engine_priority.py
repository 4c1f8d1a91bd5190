"""The `priority` the gateway sends vLLM with each request: its tier first, then whether its
tenant holds more than its share of the model.

vLLM's priority scheduling (`scheduling_policy: priority`; vLLM 0.32.0 vllm/config/scheduler.py,
vllm/v1/core/sched/request_queue.py `PriorityRequestQueue`) orders the waiting requests by
(priority, arrival time), lower first, and when the KV cache runs out it preempts the running
request with the largest (priority, arrival) (vllm/v1/core/sched/scheduler.py). The same
scheduler runs on CPU and GPU. So a request sent with a lower number is prefilled sooner and
preempted later.

Today the gateway sends the key's tier rank (0 = the first tier; serving.gateway.admission,
`gateway.queue.engine_priority`). `engine_priority` keeps that order between tiers and, within a
tier, puts a tenant under its share of the model ahead of one over it, in `SHARE_BANDS` bands:

    priority = tier rank x SHARE_BANDS + band

so the worst band of a tier still goes before the best of the next tier. A tenant's share is the
fair queue's own (fair_queue.lua `over_share`, the reserve's rule): the model's capacity split
among the tenants holding slots of it, and never more than half of it, unweighted.
"""

from __future__ import annotations

SHARE_BANDS = 4  # under its share; up to 2x; up to 4x; beyond


def share_band(held: int, capacity: int, holders: int) -> int:
    """0 when the tenant holds less than its share of the model's `capacity` (counting this
    request among its `held`), then 1, 2, 3 for up to twice, four times, and beyond.
    `holders`: the tenants holding slots of the model."""
    if held <= 0:
        return 0
    usage = held * max(2, holders) / max(1, capacity)  # 1 = exactly its share
    if usage < 1:
        return 0
    if usage < 2:
        return 1
    return 2 if usage < 4 else 3


def engine_priority(tier_rank: int, held: int, capacity: int, holders: int) -> int:
    """vLLM's `priority` (lower runs first) for a request of tier `tier_rank` (0 = first) whose
    tenant holds `held` of the model's `capacity` slots, this request included, with `holders`
    tenants holding slots."""
    if tier_rank < 0:
        raise ValueError(f"tier rank must be 0 or more, got {tier_rank}")
    return tier_rank * SHARE_BANDS + share_band(held, capacity, holders)
