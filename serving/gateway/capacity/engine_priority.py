"""The `priority` the gateway sends vLLM with each request: its tier first, then whether its
tenant holds more than its share of the model.

vLLM's priority scheduling (`scheduling_policy: priority`; vLLM 0.32.0 vllm/config/scheduler.py,
vllm/v1/core/sched/request_queue.py `PriorityRequestQueue`) orders the waiting requests by
(priority, arrival time), lower first, and when the KV cache runs out it preempts the running
request with the largest (priority, arrival) (vllm/v1/core/sched/scheduler.py). The same
scheduler runs on CPU and GPU. So a request sent with a lower number is prefilled sooner and
preempted later.

The gateway derives it from what the fair queue answers when the request takes its slot
(serving.gateway.queue.fair_queue `TenantShare`, from fair_queue.lua `share_of`): the tier order
first, then, within a tier, a tenant under its share of the model ahead of one over it, in
`SHARE_BANDS` bands:

    priority = tier rank x SHARE_BANDS + band

so the worst band of a tier still goes before the best of the next tier. A tenant's share is
the model's capacity split among the tenants holding slots in proportion to their weights (a
key's `weight`, as the fair queue's order uses it), and never more than half of it (as the fair
queue's reserve rule: a tenant alone is not "under its share" with the whole model): the
reserve's own rule (fair_queue.lua `over_share`). A request whose share is
unknown (its admission was learned from a lease renewal, not the wake-up) gets its tier's last
band: an unknown share never goes first.
"""

from __future__ import annotations

SHARE_BANDS = 4  # under its share; up to 2x; up to 4x; beyond


def share_band(held: int, capacity: int, holders: int, *, weight: float = 1.0, weights: float | None = None) -> int:
    """0 when the tenant holds less than its share of the model's `capacity` (counting this
    request among its `held`), then 1, 2, 3 for up to twice, four times, and beyond.
    `holders`: the tenants holding slots of the model; `weight`: this tenant's, `weights`: the sum
    of the holders' (None: all weigh 1)."""
    if held <= 0:
        return 0
    weight = weight if weight > 0 else 1.0
    total = float(holders) if weights is None else weights
    # share = capacity x weight / max(total, 2 x weight); usage 1 = exactly its share
    usage = held * max(total, 2 * weight) / (weight * max(1, capacity))
    if usage < 1:
        return 0
    if usage < 2:
        return 1
    return 2 if usage < 4 else 3


def engine_priority(
    tier_rank: int, held: int, capacity: int, holders: int, *, weight: float = 1.0, weights: float | None = None
) -> int:
    """vLLM's `priority` (lower runs first) for a request of tier `tier_rank` (0 = first) whose
    tenant (of `weight`) holds `held` of the model's `capacity` slots, this request included,
    with `holders` tenants holding slots, weighing `weights` together."""
    if tier_rank < 0:
        raise ValueError(f"tier rank must be 0 or more, got {tier_rank}")
    return tier_rank * SHARE_BANDS + share_band(held, capacity, holders, weight=weight, weights=weights)


def unknown_share_priority(tier_rank: int) -> int:
    """The priority of a request whose tenant's share is not known: its tier's last band."""
    if tier_rank < 0:
        raise ValueError(f"tier rank must be 0 or more, got {tier_rank}")
    return tier_rank * SHARE_BANDS + SHARE_BANDS - 1
