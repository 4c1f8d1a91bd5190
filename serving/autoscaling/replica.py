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

import logging
from importlib.metadata import entry_points

from ray.serve.llm import LLMServer as RayLLMServer

from serving.autoscaling import engine_stats
from serving.autoscaling.signals import engine_metrics

log = logging.getLogger("ray.serve.llmstack_autoscaling")
PLUGIN_GROUP = "vllm.stat_logger_plugins"  # vllm.plugins.STAT_LOGGER_PLUGINS_GROUP


def tap_installed() -> bool:
    """vLLM will load `engine_stats.SchedulerLoadTap`: llmstack is installed with its entry points."""
    tap = f"{engine_stats.__name__}:{engine_stats.SchedulerLoadTap.__name__}"
    return any(point.value == tap for point in entry_points(group=PLUGIN_GROUP))


class LLMServer(RayLLMServer):  # type: ignore[misc]  # Ray's types are Any to mypy
    _checked_tap = False

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's waiting requests and KV cache use (empty until its first step)."""
        if not LLMServer._checked_tap:
            LLMServer._checked_tap = True
            if not tap_installed():
                # Without engine figures the policy never sees the replicas quiet: it would not scale down.
                log.error(
                    "llmstack's vLLM stat logger (entry point %s) is not installed: this replica reports no "
                    "engine figures and the saturation policy will not scale the model down; install "
                    "llmstack as a package (pip install), not only on PYTHONPATH",
                    PLUGIN_GROUP,
                )
        return engine_metrics(engine_stats.latest().values())
