"""The Serve autoscaling policy of a model with `autoscaling.policy: saturation`.

Ray Serve 2.60 takes a deployment's policy in `autoscaling_config.policy`: `policy_function` is
an import path, and a class there is built once with `policy_kwargs` (JSON) and then called
with an `AutoscalingContext` on every autoscaling tick in Serve's controller; it returns the
replica count it wants and its state (ray/serve/config.py `AutoscalingPolicy`,
ray/serve/_private/autoscaling_state.py `_resolve_policy_callable`). Serve wraps it with the
deployment's own upscale/downscale delays, scaling factors and bounds
(ray/serve/autoscaling_policy.py `_apply_autoscaling_config`), as for its default policy.

    autoscaling_config:
      policy:
        policy_function: serving.autoscaling.policy:SaturationPolicy
        policy_kwargs: {thresholds: {...}, queue: {model: llama, tiers: 3, ...}}

The engine's figures come from the replicas (`replica.LLMServer.record_autoscaling_stats`),
the gateway queue's from the gateway's Redis (`gateway_queue`); the decision is
`decision.decide`.
"""

from __future__ import annotations

import logging
from typing import Any

from serving.autoscaling.decision import Decision, Replicas, SaturationThresholds, Why, decide
from serving.autoscaling.gateway_queue import GatewayQueue, QueueSource
from serving.autoscaling.signals import QueueFigures, signals

POLICY_FUNCTION = "serving.autoscaling.policy:SaturationPolicy"
STATE_KEY = "llmstack_saturation"  # the last decision's reason, kept in Serve's policy state
# A gateway queue nobody can read (the gateway queues nothing for the model, or the controller
# has no Redis URL) is not a signal: it neither scales up nor holds a scale-down. One that is
# configured but unread (Redis down, figures stale) is unknown, and holds scale-downs.
NOT_WATCHED = QueueFigures(depth=0, expected_wait_s=0.0)

# Under Serve's logger ("ray.serve"): the policy runs in Serve's controller, whose log it joins.
log = logging.getLogger("ray.serve.llmstack_autoscaling")


class SaturationPolicy:
    """`policy_kwargs`: `thresholds` (SaturationThresholds' fields) and `queue` (QueueSource's
    fields; absent when the gateway queues nothing for the model)."""

    def __init__(self, thresholds: dict[str, Any] | None = None, queue: dict[str, Any] | None = None) -> None:
        self.thresholds = SaturationThresholds.model_validate(thresholds or {})
        self.queue = GatewayQueue(QueueSource(**queue)) if queue else None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = self.decide(ctx)
        state = dict(ctx.policy_state or {})
        if state.get(STATE_KEY) != decision.why.value and decision.why is not Why.HOLD:
            log.info(
                "deployment %s: %d running, %d wanted (%s)",
                ctx.deployment_name,
                ctx.current_num_replicas,
                decision.replicas,
                decision.why.value,
            )
        state[STATE_KEY] = decision.why.value
        return decision.replicas, state

    def decide(self, ctx: Any) -> Decision:
        """The decision for one `AutoscalingContext`."""
        now = ctx.current_time
        changes = [t for t in (ctx.last_scale_up_time, ctx.last_scale_down_time) if t is not None]
        queue = self.queue.figures() if self.queue is not None and self.queue.watched else NOT_WATCHED
        seen = signals(ctx.total_num_requests, ctx.aggregated_metrics, ctx.running_replicas, queue)
        replicas = Replicas(
            running=ctx.current_num_replicas,
            target=ctx.target_num_replicas,
            min=ctx.capacity_adjusted_min_replicas,
            max=ctx.capacity_adjusted_max_replicas,
            target_ongoing_requests=ctx.config.get_target_ongoing_requests(),
        )
        return decide(seen, replicas, self.thresholds, now=now, last_change=max(changes) if changes else None)
