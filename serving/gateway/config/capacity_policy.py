"""What the stack says about a model's latency, and what the gateway does to keep it.

`LatencyTarget` is one model's `latency_target:` block in the stack file (a field of
infra.spec.ModelSpec), so the stack file and the gateway read one model. `ModelCapacity` is what
one gateway process needs per served model: the targets (the stack's, or the defaults
infra.plan.latency_target derives from the planner's estimates) and the bounds the capacity moves
between.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from serving.gateway.config.strict_model import StrictModel


class LatencyTarget(StrictModel):
    """`llmstack:models[].latency_target`: the latency a model's streams should see, and whether
    the gateway moves the model's capacity to keep it."""

    ttft_ms: float | None = Field(
        default=None,
        gt=0,
        description="Time to first token the model should keep, in ms, measured by the gateway from forwarding the "
        "request to the first streamed token (its wait in the gateway's queue is not part of it). "
        "Default: 8 x itl_ms.",
    )
    itl_ms: float | None = Field(
        default=None,
        gt=0,
        description="Inter-token latency the model should keep, in ms: the gap between two streamed chunks. "
        "Default: 3 x the gap each stream sees when a replica runs max_ongoing_requests streams at "
        "the planner's estimate of its output tokens/s (its GPU class, GPUs and weight bytes), and "
        "at least 50 (infra/plan/latency_target.py says why).",
    )
    percentile: float = Field(
        default=90.0,
        gt=50,
        lt=100,
        description="The percentile of the measured TTFTs and ITLs that must stay within the targets, e.g. 90 (p90).",
    )
    adaptive: bool = Field(
        default=True,
        description="Move the model's capacity (requests in flight per replica) to keep the targets: down when "
        "the engine is slower than the target, up again when it is faster and the capacity is in "
        "use. Requests beyond it wait in the gateway's fair queue instead of inside the engine. "
        "Off: the capacity is autoscaling.max_ongoing_requests per replica, always.",
    )
    min_slots: int = Field(
        default=2,
        ge=1,
        description="The fewest requests in flight per replica the adaptation may go down to, however slow the "
        "engine is: below it the model would serve too few to measure.",
    )


class ModelCapacity(StrictModel):
    """One served model's adaptive capacity, as the gateway sees it (rendered per model)."""

    ttft_ms: float = Field(gt=0, description="p<percentile> time to first token to keep, ms.")
    itl_ms: float = Field(gt=0, description="p<percentile> inter-token latency to keep, ms.")
    percentile: float = Field(default=90.0, gt=50, lt=100, description="Percentile the targets apply to.")
    adaptive: bool = Field(default=True, description="Move the capacity to keep the targets.")
    min_slots: int = Field(default=2, ge=1, description="Fewest requests in flight per replica.")
    max_slots: int = Field(ge=1, description="Most requests in flight per replica: Serve's max_ongoing_requests.")

    @model_validator(mode="after")
    def _ordered(self) -> ModelCapacity:
        if self.min_slots > self.max_slots:
            raise ValueError(f"min_slots {self.min_slots} exceeds max_slots {self.max_slots} (max_ongoing_requests)")
        return self
