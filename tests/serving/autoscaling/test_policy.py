"""The saturation policy as Ray Serve builds and calls it: from the rendered `autoscaling_config`
through Ray's own AutoscalingConfig / AutoscalingPolicy (cloudpickled, instantiated with its
policy_kwargs, wrapped with Serve's delays and bounds) to a decision on a real
AutoscalingContext; and the engine figures a replica reports under the names the policy reads."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from vllm.v1.metrics.stats import SchedulerStats

from infra.render.serve_config import deployment_overrides
from infra.spec.stack_file import spec_from_document
from serving.autoscaling import engine_stats
from serving.autoscaling.engine_stats import SchedulerLoadTap
from serving.autoscaling.gateway_queue import REDIS_URL_ENV
from serving.autoscaling.policy import STATE_KEY
from serving.autoscaling.replica import LLMServer
from serving.autoscaling.signals import ENGINE_WAITING, KV_CACHE_USE
from tests.support.stacks import stack_document

DEPLOYMENT = DeploymentID(name="LLMServer:llama", app_name="llama")


def rendered_config(**saturation) -> AutoscalingConfig:
    """The model's `autoscaling_config` as `llmctl render` writes it, parsed by Ray (no delays:
    this tests the decision, not Serve's timers)."""
    doc = stack_document(
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "autoscaling": {
                    "policy": "saturation",
                    "min_replicas": 1,
                    "max_replicas": 4,
                    "upscale_delay_s": 0,
                    "downscale_delay_s": 0,
                    "saturation": {"cooldown_s": 0, **saturation},
                },
            }
        ]
    )
    spec = spec_from_document(doc, name="t", file_label="t")
    return AutoscalingConfig(**deployment_overrides(spec.models[0], spec)["autoscaling_config"])


def policy_as_serve_runs_it(config: AutoscalingConfig):
    # What DeploymentAutoscalingState.register does with a deployment's config.
    return _apply_autoscaling_config(_resolve_policy_callable(config.policy))


def context(
    config: AutoscalingConfig,
    *,
    running: int,
    target: int | None = None,
    ongoing: float = 2.0,
    metrics: dict[str, list[float]] | None = None,
    state: dict | None = None,
) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(running)]
    aggregated = {name: dict(zip(replicas, values)) for name, values in (metrics or {}).items()}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=running,
        target_num_replicas=running if target is None else target,
        running_replicas=replicas,
        total_num_requests=lambda: ongoing,
        total_queued_requests=lambda: 0.0,
        aggregated_metrics=lambda: aggregated,
        raw_metrics=lambda: {},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=config,
    )


@pytest.fixture(autouse=True)
def no_gateway_redis(monkeypatch):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)  # the gateway's figures are test_gateway_queue's


def test_the_rendered_policy_is_a_custom_policy_ray_serializes():
    config = rendered_config()
    assert not config.policy.is_default_policy_function()
    assert config.policy.policy_function == "serving.autoscaling.policy:SaturationPolicy"
    assert config.policy.get_serialized_policy_def()  # Serve ships it to the controller pickled


@pytest.mark.parametrize(
    "metrics",
    [
        {ENGINE_WAITING: [1.0, 2.0], KV_CACHE_USE: [0.2, 0.2]},  # 3 waiting over 2 replicas
        {ENGINE_WAITING: [0.0, 0.0], KV_CACHE_USE: [0.95, 0.9]},  # long prompts: KV full at 2 in flight
    ],
)
def test_an_engine_signal_adds_a_replica_where_ongoing_requests_would_not(metrics):
    config = rendered_config()
    ctx = context(config, running=2, ongoing=2.0, metrics=metrics)
    replicas, state = policy_as_serve_runs_it(config)(ctx)
    assert replicas == 3
    assert state[STATE_KEY] in ("engine_waiting", "kv_cache")
    # Serve's default policy on the same context: 2 ongoing over 2 replicas at 16 each wants 1.
    default = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0)
    assert (
        _apply_autoscaling_config(_resolve_policy_callable(default.policy))(
            context(default, running=2, ongoing=2.0, metrics=metrics)
        )[0]
        < 2
    )


def test_all_quiet_removes_one_and_a_replica_without_figures_holds():
    config = rendered_config()
    quiet = {ENGINE_WAITING: [0.0, 0.0, 0.0], KV_CACHE_USE: [0.1, 0.1, 0.1]}
    assert policy_as_serve_runs_it(config)(context(config, running=3, ongoing=1.0, metrics=quiet))[0] == 2
    loading = {ENGINE_WAITING: [0.0, 0.0], KV_CACHE_USE: [0.1, 0.1]}  # the third has not reported yet
    assert policy_as_serve_runs_it(config)(context(config, running=3, ongoing=1.0, metrics=loading))[0] == 3


def test_the_thresholds_come_from_the_stack_file():
    config = rendered_config(kv_cache_high=0.6, kv_cache_low=0.3)
    metrics = {ENGINE_WAITING: [0.0], KV_CACHE_USE: [0.7]}
    assert policy_as_serve_runs_it(config)(context(config, running=1, ongoing=1.0, metrics=metrics))[0] == 2


def test_serve_keeps_its_bounds_around_the_policy():
    config = rendered_config()
    full = {ENGINE_WAITING: [9.0] * 4, KV_CACHE_USE: [1.0] * 4}
    assert policy_as_serve_runs_it(config)(context(config, running=4, ongoing=8.0, metrics=full))[0] == 4


def tap_record(tap: SchedulerLoadTap, waiting: int, kv: float, engine: int = 0) -> None:
    tap.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=waiting, kv_cache_usage=kv), None, engine_idx=engine)


def test_a_replica_reports_its_engine_figures_under_the_policys_names():
    engine_stats.forget()

    def report() -> dict[str, float]:
        # The report reads the process's engine figures, none of the (engine-starting) server's state.
        return asyncio.run(LLMServer.record_autoscaling_stats(SimpleNamespace()))

    assert report() == {}  # before the engine's first step: nothing to average
    tap = SchedulerLoadTap(vllm_config=None)
    tap_record(tap, waiting=3, kv=0.4)
    tap.record(None, None)  # a step without scheduler figures keeps the last ones
    tap_record(tap, waiting=1, kv=0.8, engine=1)  # a second engine (data parallel) of the same replica
    assert report() == {ENGINE_WAITING: 4.0, KV_CACHE_USE: 0.8}
    assert all(isinstance(v, float) for v in report().values())  # Serve disables reports of other types
    engine_stats.forget()


def test_the_replica_class_keeps_rays_name_and_adds_only_the_report():
    from ray.serve.llm import LLMServer as RayLLMServer

    assert LLMServer.__name__ == RayLLMServer.__name__  # the deployment stays `LLMServer:<model>`
    assert [name for name in vars(LLMServer) if not name.startswith("_")] == ["record_autoscaling_stats"]


def test_vllms_own_loader_finds_the_tap_through_the_entry_point_pyproject_declares(tmp_path, monkeypatch):
    import tomllib

    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    from infra.spec.stack_file import PROJECT_ROOT
    from serving.autoscaling.replica import PLUGIN_GROUP, tap_installed

    declared = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["entry-points"][PLUGIN_GROUP]
    # What `pip install` writes from it, in a distribution of its own on the path.
    dist = tmp_path / "llmstack_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llmstack-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert tap_installed()
    assert SchedulerLoadTap in load_stat_logger_plugin_factories()
