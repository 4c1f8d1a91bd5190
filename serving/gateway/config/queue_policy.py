"""What the stack says about waiting for a saturated model: priority tiers, and each model's capacity.

`QueuePolicy` is the stack's `gateway.queue`, a field of serving.gateway.config.gateway_policy.GatewayPolicy,
which both the stack spec and the gateway's settings extend: the stack file, `llmctl plan` and
the gateway read one model.
`ModelQueue` is what the gateway needs per served model; the renderer derives it from the
model's `autoscaling` block (see `infra.plan.cold_start` for the cold-start timeout).

Tiers are strict priorities: a waiter of an earlier tier is always admitted before any waiter of
a later one. Within a tier, tenants share by weight (serving.gateway.queue.fair_share).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from serving.gateway.config.strict_model import StrictModel

TIER_NAME = r"^[a-z][a-z0-9_-]{0,31}$"


class QueueTier(StrictModel):
    name: str = Field(pattern=TIER_NAME, description="Tier name that key records refer to, e.g. interactive.")
    max_queue_length: int = Field(
        default=256,
        ge=0,
        description="Most requests of this tier waiting per model, across all gateway replicas. "
        "0: never wait; a saturated model refuses the request at once.",
    )
    queue_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest a request of this tier waits for a slot before it is refused (429 or 503). "
        "A model scaling from zero waits up to its cold_start_timeout_s instead, when longer.",
    )
    capacity_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Fraction of a model's capacity requests of this tier may fill. Below 1, the rest stays free "
        "for earlier tiers, so their requests need not wait for a slot to free. Never larger than "
        "an earlier tier's.",
    )


def _default_tiers() -> list[QueueTier]:
    return [
        QueueTier(name="interactive", queue_timeout_s=30.0),
        QueueTier(name="standard", queue_timeout_s=60.0),
        QueueTier(name="batch", max_queue_length=1024, queue_timeout_s=300.0, capacity_share=0.75),
    ]


class QueuePolicy(StrictModel):
    """Admission order for saturated models (`llmstack:gateway.queue` in the stack file)."""

    enabled: bool = Field(
        default=True,
        description="Cap each model's in-flight requests at its capacity and queue the rest fairly. "
        "Off: every admitted request goes straight to Ray Serve (first come, first served).",
    )
    tiers: list[QueueTier] = Field(
        default_factory=_default_tiers,
        min_length=1,
        description="Priority tiers, highest first. A key's record names its tier.",
    )
    default_tier: str = Field(
        default="standard",
        description="Tier of keys whose record names none (or names a tier the stack no longer has).",
    )
    reserve_share: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Fraction of each model's capacity (rounded down to whole slots) kept for tenants holding "
        "less than their share of it (the capacity split among the tenants holding slots in proportion to "
        "their keys' weights, never more than half of it), so that on a saturated model a light tenant's "
        "request finds a slot free at once "
        "instead of waiting for a flooding tenant's request to end. The price: a tenant flooding "
        "alone is served with the reserve idle. 0: no reserve.",
    )
    engine_priority: bool = Field(
        default=False,
        description="Also pass each request a `priority` to vLLM (vLLM's scheduling_policy: priority): its "
        "tier first, then whether its tenant holds more than its weighted share of the model, so earlier "
        "tiers, and within a tier tenants under their share, are scheduled first inside the engine too.",
    )
    live_replicas: bool = Field(
        default=False,
        description="Follow each model's running replicas from Ray's dashboard REST API (GET "
        "/api/serve/applications/) instead of planning on max_replicas. Off by default on a "
        "cluster: it lets the internet-facing gateway pods reach the head's dashboard port, which "
        "also accepts job submissions (code on the cluster). `make dev` always follows (loopback).",
    )
    keepalive_s: float = Field(
        default=10.0,
        gt=0,
        description="A waiting streaming request gets an SSE comment this often, so proxies and clients do "
        "not time out an idle connection.",
    )

    @model_validator(mode="after")
    def _tiers_consistent(self) -> QueuePolicy:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if self.default_tier not in names:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {names}")
        shares = [t.capacity_share for t in self.tiers]
        if shares != sorted(shares, reverse=True):
            raise ValueError(
                f"capacity_share must not grow from one tier to the next (highest first), got "
                f"{dict(zip(names, shares))}"
            )
        return self

    def rank(self, tier: str | None) -> int:
        """Position of a tier (0 = highest priority); unknown and missing names get the default tier."""
        names = [t.name for t in self.tiers]
        return names.index(tier) if tier in names else names.index(self.default_tier)

    def tier(self, name: str | None) -> QueueTier:
        return self.tiers[self.rank(name)]


class ModelQueue(StrictModel):
    """One served model's capacity, as the gateway sees it."""

    max_ongoing_requests: int = Field(
        ge=1, description="Requests one replica takes at once (Serve's max_ongoing_requests)."
    )
    min_replicas: int = Field(default=1, ge=0, description="Replicas Serve keeps when idle; 0 scales to zero.")
    max_replicas: int = Field(
        default=1,
        ge=1,
        description="Replicas assumed while no live replica count has been published: the capacity never "
        "starts below what Serve could serve.",
    )
    cold_start_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="While the model has no replica, how long its requests may wait for one to start.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ModelQueue:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self
