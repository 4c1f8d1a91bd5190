"""The gateway's rendered objects: two ports (the Service publishes one), Prometheus finds the
other, and a NetworkPolicy lets only the stack's Prometheus namespace reach it. Checked on the
example stacks, and the settings JSON checked by the gateway's own loader."""

from __future__ import annotations

import json

import pytest

from infra.render.gateway import edge_health_port, gateway_api_port, gateway_objects, memory_limit_mib
from infra.spec.schema import Gateway
from infra.spec.stack_file import load_stack
from serving.gateway.config.settings import load_settings


def kind(objects: list[dict], name: str) -> list[dict]:
    return [o for o in objects if o["kind"] == name]


@pytest.fixture
def objects(example_stack):
    return gateway_objects(example_stack)


def container_of(objects: list[dict]) -> dict:
    return kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]


def edge_of(objects: list[dict]) -> dict:
    return kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][1]


def test_the_public_port_is_the_edges_and_the_metrics_port_the_gateways(example_stack, objects):
    g = example_stack.gateway
    assert {p["name"]: p["containerPort"] for p in container_of(objects)["ports"]} == {"metrics": g.metrics_port}
    assert {p["name"]: p["containerPort"] for p in edge_of(objects)["ports"]} == {
        "http": g.port,
        "edge-health": edge_health_port(example_stack),
    }
    [service] = kind(objects, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_the_edge_runs_the_rendered_haproxy_config_behind_the_proxy_protocol(example_stack, objects):
    edge = edge_of(objects)
    [config_map] = kind(objects, "ConfigMap")
    config = config_map["data"]["haproxy.cfg"]
    assert edge["command"] == ["haproxy", "-db", "-f", "/etc/llmstack/edge/haproxy.cfg"]
    assert edge["volumeMounts"][0]["mountPath"] == "/etc/llmstack/edge"
    pod = kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "edge", "configMap": {"name": config_map["metadata"]["name"]}}]
    # The gateway behind it listens on loopback only, on the port the edge forwards to.
    settings = json.loads(
        next(e["value"] for e in container_of(objects)["env"] if e["name"] == "LLMSTACK_GATEWAY_SETTINGS")
    )
    assert (settings["host"], settings["metrics_host"]) == ("127.0.0.1", "0.0.0.0")
    assert f"server gateway 127.0.0.1:{settings['port']}" in config
    [service] = kind(objects, "Service")
    if example_stack.cloud.provider == "aws":  # the NLB tells the edge each client's address
        assert f"bind :{example_stack.gateway.port} accept-proxy" in config
        assert service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-proxy-protocol"] == "*"
    else:
        assert f"bind :{example_stack.gateway.port}\n" in config
    assert "kill -USR1 1" in edge["lifecycle"]["preStop"]["exec"]["command"][-1]  # soft stop: streams finish


def test_probes_and_scraping_use_ports_no_public_flood_reaches(example_stack, objects):
    container = container_of(objects)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert edge_of(objects)["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "edge-health"}
    annotations = kind(objects, "Deployment")[0]["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations.items()
        >= {
            "prometheus.io/scrape": "true",
            "prometheus.io/path": "/metrics",
            "prometheus.io/port": str(example_stack.gateway.metrics_port),
        }.items()
    )


def test_a_changed_edge_config_rolls_the_pods(example_stack, objects):
    def edge_hash(objects: list[dict]) -> str:
        return kind(objects, "Deployment")[0]["spec"]["template"]["metadata"]["annotations"][
            "llmstack.dev/edge-config-sha256"
        ]

    g = example_stack.gateway
    tighter = example_stack.model_copy(
        update={"gateway": g.model_copy(update={"edge": g.edge.model_copy(update={"header_timeout_s": 5})})}
    )
    assert edge_hash(gateway_objects(tighter)) != edge_hash(objects)
    assert edge_hash(gateway_objects(example_stack)) == edge_hash(objects)


def test_only_the_prometheus_namespace_reaches_the_metrics_port(example_stack, objects):
    g = example_stack.gateway
    [policy] = [p for p in kind(objects, "NetworkPolicy") if p["metadata"]["name"] == "llmstack-gateway-ingress"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"llmstack.dev/component": "gateway"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(by_port) == {g.port, g.metrics_port}
    assert "from" not in by_port[g.port]  # the API: anyone, through the load balancer
    assert by_port[g.metrics_port]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": g.metrics_namespace}}}
    ]


def test_the_rendered_settings_are_what_the_gateway_loads(example_stack, objects):
    env = {e["name"]: e["value"] for e in container_of(objects)["env"] if "value" in e}
    settings = load_settings(env)
    g = example_stack.gateway
    assert (
        settings.metrics_port,
        settings.max_connections,
        settings.body_timeout_s,
        settings.max_json_depth,
        settings.allowed_body_extensions,
        settings.forward_request_headers,
    ) == (
        g.metrics_port,
        g.max_connections,
        g.body_timeout_s,
        g.max_json_depth,
        g.allowed_body_extensions,
        g.forward_request_headers,
    )
    assert settings.port == gateway_api_port(example_stack) not in (g.port, g.metrics_port)


def test_the_memory_limit_covers_every_connection_holding_a_whole_body(example_stack):
    g = example_stack.gateway
    assert memory_limit_mib(example_stack) * 2**20 >= g.max_connections * g.max_body_bytes
    twice = g.model_copy(update={"max_connections": g.max_connections * 2})
    bigger = example_stack.model_copy(update={"gateway": twice})
    assert memory_limit_mib(bigger) > memory_limit_mib(example_stack)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"metrics_port": 8080}, "metrics_port"),
        ({"allowed_body_extensions": ["top_k", "request_id"]}, "request_id"),
        ({"allowed_body_extensions": ["chat_template"]}, "chat_template"),
        ({"forward_request_headers": ["Authorization"]}, "authorization"),
        ({"metrics_namespace": "Not A Namespace"}, "metrics_namespace"),
    ],
)
def test_the_stack_refuses_unsafe_gateway_settings(fields, named):
    with pytest.raises(ValueError, match=named):
        Gateway(**fields)


def test_the_batch_api_storage_is_the_model_cache_bucket_when_known() -> None:
    spec = load_stack("prod")

    def pod_and_settings(bucket):
        deployment = next(o for o in gateway_objects(spec, model_cache_bucket=bucket) if o["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        return pod, json.loads(env["LLMSTACK_GATEWAY_SETTINGS"])

    pod, settings = pod_and_settings("acme-models")
    assert settings["batch_storage_url"] == "s3://acme-models/batches"
    assert pod["serviceAccountName"] == "llmstack-gateway" and pod["automountServiceAccountToken"] is False
    pod, settings = pod_and_settings(None)  # no bucket: no Batch API, and no AWS identity either
    assert "batch_storage_url" not in settings and "serviceAccountName" not in pod


@pytest.mark.parametrize("stream_resume", [{"enabled": True, "max_resumes": 3}, {"enabled": False, "max_resumes": 2}])
def test_the_stacks_stream_resume_setting_reaches_the_gateway(example_stack, stream_resume):
    gateway = example_stack.gateway.model_copy(
        update={"stream_resume": example_stack.gateway.stream_resume.model_copy(update=stream_resume)}
    )
    spec = example_stack.model_copy(update={"gateway": gateway})
    env = {e["name"]: e["value"] for e in container_of(gateway_objects(spec))["env"] if "value" in e}
    assert load_settings(env).stream_resume.model_dump() == stream_resume


def test_the_stack_refuses_a_stream_resume_setting_out_of_bounds():
    with pytest.raises(ValueError, match="max_resumes"):
        Gateway(stream_resume={"max_resumes": 11})
    with pytest.raises(ValueError, match="max_resume"):
        Gateway(stream_resume={"max_resume": 1})  # a misspelt key is refused, never ignored
