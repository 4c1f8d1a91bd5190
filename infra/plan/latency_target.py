"""Each model's latency target: the stack file's `latency_target`, or a default derived from what
the planner estimates.

The planner knows no latency, but it estimates how many output tokens per second one replica
of a model produces at high concurrency (serving_estimates.yaml, scaled by the replica's GPUs
and weight bytes: `infra.plan.ingress_plan`). A replica running its full `max_ongoing_requests`
streams at that rate gives each stream one token per

    full-load ITL = max_ongoing_requests / replica output tokens/s

and the defaults are, with headroom:

    itl_ms  = max(ITL_FLOOR_MS, ITL_HEADROOM x full-load ITL)
    ttft_ms = TTFT_PER_ITL x itl_ms

- ITL_HEADROOM 3: the figure is a saturated throughput that errs high (it sizes the ingress,
  where too high is the safe side), and a p90 gap includes the steps that also carry other
  requests' prefill chunks. A target too tight costs throughput (the capacity is cut although
  users are served well); too loose, the adaptation engages only when the engine is overloaded.
- ITL_FLOOR_MS 50 (20 tokens/s per stream, faster than people read): a faster GPU gains nothing
  from a tighter default, only a lower capacity.
- TTFT_PER_ITL 8: a first token waits for the prompt's prefill (a few chunked-prefill steps for
  a long prompt: vLLM's OpenAI server takes 2,048 prompt tokens per step by default) and for
  room in the running batch, a few steps more.

For an 8B model in 16 bits at max_ongoing_requests 64: L4 171 ms / 1.4 s (ITL / TTFT), A100-80GB
and H100 50 ms / 400 ms; `make dev`'s CPU stack states its own (Pulumi.local.yaml).
"""

from __future__ import annotations

from infra.plan.planner import StackPlan
from infra.spec.schema import ModelSpec, StackSpec
from serving.gateway.config.capacity_policy import ModelCapacity

ITL_HEADROOM = 3.0
ITL_FLOOR_MS = 50.0
TTFT_PER_ITL = 8.0


def default_itl_ms(max_ongoing_requests: int, replica_output_tokens_per_s: float) -> float:
    full_load_itl_ms = 1000 * max_ongoing_requests / replica_output_tokens_per_s
    return round(max(ITL_FLOOR_MS, ITL_HEADROOM * full_load_itl_ms))


def model_capacity(model: ModelSpec, replica_output_tokens_per_s: float) -> ModelCapacity:
    """What the gateway needs to adapt `model`'s capacity: the stated targets, defaults for the
    rest, and the bounds (the floor, and Serve's max_ongoing_requests per replica)."""
    target = model.latency_target
    max_slots = model.autoscaling.max_ongoing_requests
    itl = target.itl_ms or default_itl_ms(max_slots, replica_output_tokens_per_s)
    ttft = target.ttft_ms or round(TTFT_PER_ITL * itl)
    return ModelCapacity(
        ttft_ms=ttft,
        itl_ms=itl,
        percentile=target.percentile,
        adaptive=target.adaptive,
        min_slots=min(target.min_slots, max_slots),
        max_slots=max_slots,
    )


def model_capacities(spec: StackSpec, plan: StackPlan) -> dict[str, ModelCapacity]:
    """Served model name -> its adaptive capacity, for the gateway's settings. Models the plan
    could not size (unknown architecture) are left out: their capacity stays fixed."""
    if plan.ingress is None:
        return {}
    rates = {m.model_id: m.replica_output_tokens_per_s for m in plan.ingress.models}
    return {m.model_name: model_capacity(m, rates[m.id]) for m in spec.models if m.id in rates}
