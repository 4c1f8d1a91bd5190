"""The saturation policy in a real Serve controller: a local Ray with one stand-in deployment
(no engine) whose replicas report the engine figures the way `replica.LLMServer` does. Serve
deserializes the policy, builds it with its kwargs, hands it the replicas' reports, and scales
up on a full KV cache and back down once it is quiet. The deadline only bounds a hang.

It starts a Ray of its own, so it runs in the end-to-end pytest process (before the shared dev
stack starts), never beside the unit tests: two local Serve instances would contend for ports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.spec.stack_file import PROJECT_ROOT
from serving.autoscaling.policy import POLICY_FUNCTION
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


class Engine:
    """Stands in for an LLMServer replica: reports the KV use written in `kv_file`."""

    def __init__(self, kv_file: str) -> None:
        self.kv_file = kv_file

    async def record_autoscaling_stats(self) -> dict[str, float]:
        from serving.autoscaling.signals import ENGINE_WAITING, KV_CACHE_USE

        return {ENGINE_WAITING: 0.0, KV_CACHE_USE: float(Path(self.kv_file).read_text())}

    async def __call__(self) -> str:
        return "ok"


def test_serve_scales_on_the_reported_kv_use_and_back(tmp_path):
    import ray
    from ray import serve

    kv = tmp_path / "kv"
    kv.write_text("0.95")
    deployment = serve.deployment(
        Engine,
        name="Engine",
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=4,
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "look_back_period_s": 2,
            "policy": {
                "policy_function": POLICY_FUNCTION,
                "policy_kwargs": {"thresholds": {"cooldown_s": 0}, "queue": None},
            },
        },
    )
    pythonpath = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        serve.run(deployment.bind(str(kv)), name="sat")

        def running() -> int:
            return serve.status().applications["sat"].deployments["Engine"].replica_states.get("RUNNING", 0)

        assert running() == 1
        eventually(lambda: running() == 2, "a second replica for a KV cache at 0.95", bound_s=120, poll_s=0.5)
        kv.write_text("0.1")  # 0.1 over 2 replicas is 0.2 on one: under kv_cache_low
        eventually(lambda: running() == 1, "back to one replica once quiet", bound_s=120, poll_s=0.5)
    finally:
        serve.shutdown()
        ray.shutdown()
