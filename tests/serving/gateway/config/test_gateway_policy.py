"""One gateway contract: the stack spec and the gateway's settings extend one policy model, so a
field and its bound are written once, and the rendered settings carry exactly that policy."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from pydantic import ValidationError

from infra.plan.cost import estimated_throughputs, node_prices, rate_card, stack_costs
from infra.plan.planner import plan_stack
from infra.render.gateway import gateway_api_port, gateway_settings
from infra.spec.schema import Gateway
from serving.gateway.config.gateway_policy import GatewayPolicy
from serving.gateway.config.settings import GatewaySettings, load_settings
from tests.support.stacks import stack_document, write_stack


def test_spec_and_settings_take_every_policy_field_from_the_policy():
    for name, field in GatewayPolicy.model_fields.items():
        for model in (Gateway, GatewaySettings):
            assert model.model_fields[name].metadata == field.metadata, (model.__name__, name)
            assert model.model_fields[name].default == field.default or name.startswith("default_")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_body_bytes", 1023),
        ("port", 80),
        ("shutdown_grace_s", 106),
        ("max_n", 0),
        ("shadow_max_concurrent_requests", 0),
        ("chat_template_tokens", -1),
        ("default_tenant_limits", {"requests_per_minute": 0}),
    ],
)
def test_a_bound_is_the_same_in_the_stack_and_in_the_gateway(field, value):
    with pytest.raises(ValidationError, match=field):
        Gateway(**{field: value})
    with pytest.raises(ValidationError, match=field):
        GatewaySettings(upstream_url="http://serve:8000", **{field: value})


def test_the_rendered_settings_are_the_stacks_policy(tmp_path):
    from infra.spec.stack_file import load_stack

    policy = {
        "allow_plaintext": True,
        "max_n": 2,
        "chat_template_tokens": 64,
        "shadow_max_concurrent_requests": 5,
        "default_tenant_limits": {"tokens_per_minute": 50_000, "monthly_budget_usd": "1500.50"},
        "max_body_bytes": 2048,
    }
    spec = load_stack(str(write_stack(tmp_path, "policy", stack_document(gateway=policy))))
    rendered = gateway_settings(spec)
    extra = {
        "host",
        "metrics_host",
        "models",
        "model_context_lengths",
        "model_queues",
        "model_capacities",
        "model_usd_per_million_tokens",
        "model_routes",
        "model_adapters",
        "model_deployments",
        "model_media_domains",
        "tracing",  # the stack's observability.tracing, not the gateway block
    }
    assert set(json.loads(rendered)) == set(GatewayPolicy.model_fields) | extra
    settings = load_settings({"LLMSTACK_UPSTREAM_URL": "http://serve:8000", "LLMSTACK_GATEWAY_SETTINGS": rendered})
    # The stack's public port is the edge's; the gateway listens behind it, on the pod's loopback.
    assert settings.port == gateway_api_port(spec) != spec.gateway.port
    assert {**settings.policy_settings(), "port": spec.gateway.port} == spec.gateway.policy_settings()
    assert settings.default_tenant_limits.tokens_per_minute == 50_000 and settings.max_n == 2
    assert settings.default_tenant_limits.monthly_budget_usd == Decimal("1500.50")
    # Live replica counts only when the stack opts in (the gateway then reaches the dashboard port):
    # the RayService's head Service (KubeRay's "<name>-head-svc"), port 8265.
    assert settings.serve_dashboard_url is None
    following = load_stack(
        str(write_stack(tmp_path, "live", stack_document(gateway={**policy, "queue": {"live_replicas": True}})))
    )
    assert json.loads(gateway_settings(following))["serve_dashboard_url"] == (
        "http://llmstack-head-svc.llmstack.svc.cluster.local:8265"
    )
    assert settings.model_deployments == {"llama": "LLMServer:llama"}
    # The rate card budgets charge at: the plan's L4 price over the published estimate, as `llmctl cost --offline`.
    costs = stack_costs(spec, plan_stack(spec), node_prices(spec), estimated_throughputs(spec))
    assert settings.model_usd_per_million_tokens == {"llama": rate_card(costs)["llama"]} != {"llama": None}
