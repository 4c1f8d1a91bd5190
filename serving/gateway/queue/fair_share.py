"""The fair queue's decisions, as pure functions: tags, capacity, how long to wait, whom to refuse.

Within a tier, waiters are ordered by start-time fair queuing (SFQ; Goyal, Vin and Cheng,
"Start-time Fair Queueing", SIGCOMM 1996). Each tenant has a finish tag F; a new request of a
tenant gets the start tag

    S = max(V, F_tenant)            and then  F_tenant = S + cost / weight

where V, the tier's virtual time, is the start tag of the request admitted last. Waiters are
admitted in increasing S (ties: first come, first served). So:
- two backlogged tenants with weights 2 and 1 advance their tags at 1/2 and 1 per request,
  and are admitted 2:1;
- a tenant that was idle starts at V, ahead of every backlogged tenant's later requests:
  its next request is admitted next (after at most one head request of each other tenant
  that already waits at V), never behind a flood.

The Lua script (fair_queue.lua) does the same arithmetic inside Redis; these functions are the
specification the tests hold it to, and what the Python side uses to explain its answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from serving.gateway.config.queue_policy import ModelQueue

# Retry-After never says more than this: a client told to come back in an hour goes elsewhere,
# and the estimate is rough that far out.
MAX_RETRY_AFTER_S = 300.0
# With no slot released yet (no service time measured), assume a request holds its slot this
# long. Deliberately short: a too-early retry costs one more refusal, a too-late one costs idle capacity.
UNMEASURED_SERVICE_S = 2.0

Reason = Literal["queue_full", "timeout", "pushed_out", "lost"]


def tag_increment(cost: float, weight: float) -> float:
    """How far a tenant's finish tag advances per request: cost / weight."""
    if cost <= 0 or weight <= 0:
        raise ValueError(f"cost and weight must be positive, got cost={cost} weight={weight}")
    return cost / weight


def start_tag(virtual_time: float, tenant_finish: float) -> float:
    """S = max(V, F): a backlogged tenant continues after its own last tag, an idle one starts now."""
    return max(virtual_time, tenant_finish)


def capacity(live_replicas: int | None, default_replicas: int, per_replica: int) -> int:
    """Requests a model may have in flight across all gateway replicas.

    `live_replicas`: the count last published (FairQueue.set_replicas), None when nobody
    publishes one; then `default_replicas` (the stack's max_replicas) holds. At zero replicas
    one replica's worth is still let through: Ray Serve scales a deployment up from zero only
    when requests reach it (ray/serve/autoscaling_policy.py, Ray 2.60: `current_num_replicas == 0
    and total_num_requests > 0`), and those requests wait in Serve for the replica to start."""
    replicas = default_replicas if live_replicas is None else live_replicas
    return max(replicas, 1) * per_replica


def may_be_cold(live_replicas: int | None, model: ModelQueue) -> bool:
    """Whether the model may have no replica running, so that its requests wait for a cold start."""
    if live_replicas is None:
        return model.min_replicas == 0
    return live_replicas == 0


def wait_budget_s(tier_timeout_s: float, cold: bool, cold_start_timeout_s: float) -> float:
    """How long a waiter may wait for a slot: its tier's timeout, or the cold start when longer."""
    return max(tier_timeout_s, cold_start_timeout_s) if cold else tier_timeout_s


def drain_time_s(ahead: int, capacity_: int, mean_service_s: float | None) -> float:
    """Rough time until a request behind `ahead` others gets a slot: every `capacity_` slots free
    about once per mean service time (the EWMA of how long admitted requests held their slot)."""
    service = UNMEASURED_SERVICE_S if mean_service_s is None or mean_service_s <= 0 else mean_service_s
    return (ahead + 1) * service / max(capacity_, 1)


def retry_after_s(ahead: int, capacity_: int, mean_service_s: float | None) -> float:
    """Retry-After for a refused request: the drain time, in whole seconds, at least 1."""
    return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(drain_time_s(ahead, capacity_, mean_service_s)))))


@dataclass(frozen=True)
class Refusal:
    """Why a request got no slot, and the answer the gateway gives for it."""

    status: int  # 429: the tenant's own share is used up; 503: the model is saturated
    reason: Reason
    retry_after_s: float
    message: str

    @property
    def code(self) -> str:
        return "tenant_queue_share_exceeded" if self.status == 429 else "model_saturated"


def refusal(
    reason: Reason,
    *,
    tenant_waiting: int,
    ahead: int,
    capacity_: int,
    mean_service_s: float | None,
    model: str,
    tier: str,
) -> Refusal:
    """429 when the tenant's own requests are what it waits behind (it already has others queued,
    or it was pushed out because it is furthest ahead of its share); 503 when the model is
    saturated by everyone else. Retry-After from the queue's drain time either way."""
    retry = retry_after_s(ahead, capacity_, mean_service_s)
    own = reason == "pushed_out" or tenant_waiting > 0
    what = {
        "queue_full": f"the {tier!r} queue for this model is full",
        "timeout": f"no slot freed within the {tier!r} tier's queue timeout",
        "pushed_out": f"a request of a tenant under its fair share took this request's place in the "
        f"full {tier!r} queue",
        "lost": "the gateway lost this request's place in the queue",
    }[reason]
    if own:
        message = (
            f"Model {model!r} is at capacity and this API key's tenant already has {tenant_waiting} "
            f"other request(s) waiting: {what}. Send fewer requests at once, or retry after "
            f"{retry:.0f}s."
        )
        return Refusal(429, reason, retry, message)
    message = f"Model {model!r} is at capacity: {what}. Please retry after {retry:.0f}s."
    return Refusal(503, reason, retry, message)
