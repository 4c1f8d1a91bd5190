"""Ray Serve LLM's `LLMServer`, reporting its engine's saturation to Serve's autoscaler.

Serve polls a replica's `record_autoscaling_stats` (if its class has one) and hands the figures,
averaged over the look-back window, to the deployment's autoscaling policy as
`AutoscalingContext.aggregated_metrics` (ray/serve/_private/replica.py, autoscaling_state.py).
Ray's `LLMServer` has none, so a model with `autoscaling.policy: saturation` is served by this
subclass (`LLMConfig.server_cls`, infra.render.serve_config).

The class keeps Ray's name: Ray Serve LLM names the deployment `<class name>:<model>`, and
`LLMServer:<model>` is what `llmctl scale`, `llmctl status` and the dashboards know.
"""

from __future__ import annotations

from ray.serve.llm import LLMServer as RayLLMServer

from serving.autoscaling import engine_stats
from serving.autoscaling.signals import engine_metrics


class LLMServer(RayLLMServer):  # type: ignore[misc]  # Ray's types are Any to mypy
    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's waiting requests and KV cache use (empty until its first step)."""
        return engine_metrics(engine_stats.latest().values())
