"""Alert rules and the Grafana dashboard use only metrics the code (or a documented component)
exports, parse as PromQL, link existing runbooks, and each alert fires on synthetic series that
show its condition and stays quiet on healthy ones (`promtool test rules`).

PromQL is parsed with `promql-parser` (the Prometheus parser's Rust port) always, and with
Prometheus's own `promtool` when it is installed (`make test` installs Debian's prometheus).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from infra.spec.stack_file import PROJECT_ROOT
from ops.monitoring import serving_metrics
from serving.gateway.telemetry.metrics import GatewayMetrics

MONITORING = PROJECT_ROOT / "ops" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
# Grafana's variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$model": ".*"}


def known_series() -> set[str]:
    return GatewayMetrics(["m"]).names() | serving_metrics.names()


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects, from its syntax tree."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.add(node.name)
        for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if isinstance(child, promql_parser.Expr):
                visit(child)
        for arg in getattr(node, "args", None) or []:
            visit(arg)

    visit(promql_parser.parse(expr))
    return found


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def grafana_free(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_metric_names_are_read_from_the_tree():
    assert metric_names('sum(rate(a_total{x="1"}[5m])) / clamp_min(sum(rate(b_total[5m])), 1) > 0 or max(c)') == {
        "a_total",
        "b_total",
        "c",
    }


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_rule(rule: dict):
    names = metric_names(rule["expr"])
    assert names and names <= known_series(), f"unknown metrics {names - known_series()}"
    promql_parser.parse_duration(rule["for"])
    assert rule["labels"]["severity"] in ("page", "ticket")
    annotations = rule["annotations"]
    assert annotations["summary"] and annotations["description"]
    runbook = PROJECT_ROOT / annotations["runbook_url"]
    assert annotations["runbook_url"].startswith("ops/runbooks/") and runbook.is_file(), annotations["runbook_url"]
    assert rule["alert"] in runbook.read_text(), f"{runbook.name} should name the alert that sends people there"


def test_alerts_cover_the_issue_list():
    exprs = {r["alert"]: r["expr"] for r in alert_rules()}
    wanted = {  # what the issue asks to alert on -> a metric that shows it
        "error rate": "llmstack_gateway_requests_total",
        "TTFT p99": "llmstack_gateway_time_to_first_token_seconds_bucket",
        "queue depth": "ray_vllm_num_requests_waiting",
        "rate-limit rejections": "llmstack_gateway_rate_limited_total",
        "Redis errors": "llmstack_gateway_redis_errors_total",
        "GPU pending": "kube_pod_status_unschedulable",
        "Redis memory": "llmstack_gateway_redis_memory_used_bytes",
        "Redis refusing writes": "llmstack_gateway_redis_out_of_memory_total",
        "Redis evicting": "llmstack_gateway_redis_evicting",
        "XID errors": "DCGM_EXP_XID_ERRORS_COUNT",
        "GPU memory near full": "DCGM_FI_DEV_FB_FREE",
        "GPU idle under load": "DCGM_FI_DEV_GPU_UTIL",
        "GPU exporter not ready": "kube_daemonset_status_number_ready",
        "stream resumes rising": "llmstack_gateway_stream_resumes_total",
        "stream resumes failing": "llmstack_gateway_stream_resume_failures_total",
    }
    for concern, metric in wanted.items():
        assert any(metric in metric_names(e) for e in exprs.values()), f"no alert on {concern}"


def test_dashboard_is_valid_and_uses_known_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "model"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    used: set[str] = set()
    for title, expr in dashboard_targets():
        names = metric_names(grafana_free(expr))
        assert names <= known_series(), f"panel {title!r}: unknown metrics {names - known_series()}"
        used |= names
    gateway_families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in GatewayMetrics(["m"]).names()}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert gateway_families <= shown, f"gateway metrics missing from the dashboard: {gateway_families - shown}"


def test_ray_metric_names_are_the_ones_ray_documents():
    """Each ray_* name appears in the Grafana dashboards Ray ships (its documented queries), and
    each ray_vllm_* name is a vLLM metric (`vllm:<name>`) in the installed vLLM."""
    import ray

    ray_root = Path(ray.__file__).parent.parent
    dashboards = "".join(p.read_text() for p in (ray_root / serving_metrics.RAY_DASHBOARDS).glob("*.py"))
    vllm_loggers = ray_root / "vllm" / "v1" / "metrics" / "loggers.py"
    vllm_names = set(re.findall(r'name="vllm:(\w+)"', vllm_loggers.read_text())) if vllm_loggers.is_file() else None
    for metric in serving_metrics.SERVING_METRICS:
        if not metric.name.startswith("ray_"):
            continue
        assert metric.name in dashboards, f"{metric.name} is not in Ray's bundled dashboards"
        assert (ray_root / metric.source).is_file(), metric.source
        if metric.name.startswith("ray_vllm_") and vllm_names is not None:
            assert re.sub(r"_total$", "", metric.name.removeprefix("ray_vllm_")) in vllm_names, metric.name


def test_gpu_queries_use_the_node_label_of_the_pinned_exporter():
    """dcgm-exporter renamed its node label from `Hostname` to `hostname` after 4.8.2: moving the
    pin means moving every query that groups by it (and this check's version)."""
    from infra.catalog.versions import DCGM_EXPORTER_IMAGE

    exporter = DCGM_EXPORTER_IMAGE.rsplit(":", 1)[1].split("-")[1]
    assert exporter == "4.8.2", f"re-check the exporter's label names (render_metrics.go) for {exporter}"
    exprs = [r["expr"] for r in alert_rules()] + [e for _, e in dashboard_targets()]
    gpu_exprs = [e for e in exprs if "DCGM_" in e]
    assert any(serving_metrics.DCGM_NODE_LABEL in e for e in gpu_exprs)
    assert not any(re.search(r"\bhostname\b", e) for e in gpu_exprs)


# --- promtool ------------------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
# On a laptop without it the checks above (promql-parser) still ran; CI must run these too, so
# there a missing promtool (its `make test` install failed) is a failure, not a skip.
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and os.environ.get("CI") != "true",
    reason="promtool not installed (apt-get install prometheus; `make test` does); "
    "the PromQL checks above ran with promql-parser",
)


def test_ci_has_promtool():
    if os.environ.get("CI") == "true":
        assert PROMTOOL, "promtool is missing under CI: `make promtool` could not install Debian's prometheus"


EXPORTER = 'namespace="llmstack",daemonset="llmstack-dcgm-exporter"'
GPU = 'Hostname="n1",gpu="0",modelName="NVIDIA L4",namespace="llmstack",pod="w1",container="ray-worker"'
# alert -> (series that show the condition, when to evaluate, labels the alert carries)
FIRING = {
    "LLMStackHighErrorRate": (
        [
            ('llmstack_gateway_requests_total{status="200",model="m",tenant="t"}', "0+90x30"),
            ('llmstack_gateway_requests_total{status="503",model="m",tenant="t"}', "0+10x30"),
        ],
        "15m",
        {},
    ),
    "LLMStackTTFTP99High": (
        [
            ('llmstack_gateway_time_to_first_token_seconds_bucket{model="m",le="5"}', "0+0x40"),
            ('llmstack_gateway_time_to_first_token_seconds_bucket{model="m",le="30"}', "0+10x40"),
            ('llmstack_gateway_time_to_first_token_seconds_bucket{model="m",le="+Inf"}', "0+10x40"),
        ],
        "30m",
        {"model": "m"},
    ),
    "LLMStackRateLimitRejections": (
        [
            ('llmstack_gateway_requests_total{status="429",model="m",tenant="t"}', "0+100x30"),
            ('llmstack_gateway_rate_limited_total{limit="requests",mode="enforced"}', "0+50x30"),
        ],
        "20m",
        {},
    ),
    "LLMStackRedisErrors": ([("llmstack_gateway_degraded", "1x10")], "5m", {}),
    "LLMStackRedisMemoryHigh": (
        [
            ("llmstack_gateway_redis_memory_used_bytes", "900x10"),
            ("llmstack_gateway_redis_memory_max_bytes", "1000x10"),
        ],
        "5m",
        {},
    ),
    "LLMStackEngineQueueDeep": (
        [('ray_vllm_num_requests_waiting{model_name="m",WorkerId="w1"}', "40x20")],
        "15m",
        {"model_name": "m"},
    ),
    "LLMStackServeQueueDeep": (
        [('ray_serve_deployment_queued_queries{application="llm",deployment="d",handle="h"}', "100x20")],
        "15m",
        {"application": "llm", "deployment": "d"},
    ),
    "LLMStackGPUPodsPending": (
        [('kube_pod_status_unschedulable{namespace="llmstack",pod="p"}', "1x30")],
        "20m",
        {"pod": "p"},
    ),
    "LLMStackReplicaCrashLoop": (
        [
            (
                'kube_pod_container_status_waiting_reason{namespace="llmstack",pod="p",'
                'container="c",reason="CrashLoopBackOff"}',
                "1x20",
            )
        ],
        "10m",
        {"pod": "p"},
    ),
    # 3 of 100 requests a minute resumed.
    "LLMStackStreamResumesRising": (
        [
            ('llmstack_gateway_requests_total{status="200",model="m",tenant="t"}', "0+100x30"),
            ('llmstack_gateway_stream_resumes_total{model="m",reason="connection_reset"}', "0+3x30"),
        ],
        "25m",
        {"model": "m"},
    ),
    "LLMStackMonthlyBudgetNearlySpent": (
        [('llmstack_gateway_budget_used_ratio{tenant="t",key_id="k"}', "0.85x20")],
        "10m",
        {"tenant": "t", "key_id": "k"},
    ),
    # GPUs: `pod` on DCGM series is the pod holding the GPU; on ray_vllm_* the pod scraped.
    "LLMStackGPUXidError": (
        [(f'DCGM_EXP_XID_ERRORS_COUNT{{{GPU},xid="79",window_size_in_ms="300000"}}', "0 0 1x10")],
        "5m",
        {"Hostname": "n1", "gpu": "0", "xid": "79"},
    ),
    "LLMStackGPUMemoryNearFull": (
        [(f"DCGM_FI_DEV_FB_FREE{{{GPU}}}", "200x20"), (f"DCGM_FI_DEV_FB_USED{{{GPU}}}", "22800x20")],
        "15m",
        {"Hostname": "n1", "gpu": "0", "pod": "w1"},
    ),
    # Requests wait in the engine, none runs, the GPU does nothing: a hung engine.
    "LLMStackGPUIdleUnderLoad": (
        [
            (f"DCGM_FI_DEV_GPU_UTIL{{{GPU}}}", "2x20"),
            ('ray_vllm_num_requests_running{model_name="m",pod="w1"}', "0x20"),
            ('ray_vllm_num_requests_waiting{model_name="m",pod="w1"}', "5x20"),
        ],
        "15m",
        {"pod": "w1", "model_name": "m"},
    ),
    "LLMStackGPUMetricsMissing": (
        [
            (f"kube_daemonset_status_desired_number_scheduled{{{EXPORTER}}}", "2x30"),
            (f"kube_daemonset_status_number_ready{{{EXPORTER}}}", "1x30"),
        ],
        "20m",
        {"daemonset": "llmstack-dcgm-exporter"},
    ),
}
# Healthy traffic: nothing fires.
QUIET = [
    ('llmstack_gateway_requests_total{status="200",model="m",tenant="t"}', "0+100x40"),
    ('llmstack_gateway_requests_total{status="503",model="m",tenant="t"}', "0+1x40"),
    ('llmstack_gateway_time_to_first_token_seconds_bucket{model="m",le="0.5"}', "0+100x40"),
    ('llmstack_gateway_time_to_first_token_seconds_bucket{model="m",le="+Inf"}', "0+100x40"),
    ('llmstack_gateway_rate_limited_total{limit="requests",mode="enforced"}', "0+1x40"),
    ("llmstack_gateway_degraded", "0x40"),
    # A replica lost now and then: a resume every ten minutes, none failed.
    ('llmstack_gateway_stream_resumes_total{model="m",reason="connection_reset"}', "0+0.1x40"),
    ('llmstack_gateway_stream_resume_failures_total{model="m",reason="connection_reset"}', "0x40"),
    ("llmstack_gateway_redis_memory_used_bytes", "500x40"),
    ("llmstack_gateway_redis_memory_max_bytes", "1000x40"),
    ("llmstack_gateway_redis_evicting", "0x40"),
    ('llmstack_gateway_redis_out_of_memory_total{component="limiter"}', "0x40"),
    ('ray_vllm_num_requests_waiting{model_name="m",WorkerId="w1"}', "3x40"),
    ('kube_pod_status_unschedulable{namespace="llmstack",pod="p"}', "0x40"),
    ('llmstack_gateway_budget_used_ratio{tenant="t",key_id="k"}', "0.5x40"),
    # A busy GPU (10% free is what vLLM's default 0.9 leaves), and an idle one with nothing to do.
    ('DCGM_EXP_XID_ERRORS_COUNT{Hostname="n1",gpu="0",xid="13"}', "0x40"),
    ('DCGM_FI_DEV_FB_FREE{Hostname="n1",gpu="0",namespace="llmstack",pod="busy"}', "2400x40"),
    ('DCGM_FI_DEV_FB_USED{Hostname="n1",gpu="0",namespace="llmstack",pod="busy"}', "20600x40"),
    ('DCGM_FI_DEV_GPU_UTIL{Hostname="n1",gpu="0",namespace="llmstack",pod="busy"}', "85x40"),
    ('ray_vllm_num_requests_running{model_name="m",pod="busy"}', "4x40"),
    ('DCGM_FI_DEV_GPU_UTIL{Hostname="n2",gpu="0",namespace="llmstack",pod="idle"}', "0x40"),
    ('ray_vllm_num_requests_running{model_name="m2",pod="idle"}', "0x40"),
    ('ray_vllm_num_requests_waiting{model_name="m2",pod="idle"}', "0x40"),
    (f"kube_daemonset_status_desired_number_scheduled{{{EXPORTER}}}", "2x40"),
    (f"kube_daemonset_status_number_ready{{{EXPORTER}}}", "2x40"),
]


def test_every_alert_has_a_firing_scenario():
    assert set(FIRING) == {r["alert"] for r in alert_rules()}


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_each_alert_fires_on_its_condition_and_not_on_healthy_traffic(tmp_path):
    rules = {r["alert"]: r for r in alert_rules()}
    tests = []
    for alert, (series, at, labels) in FIRING.items():
        expected = {"exp_labels": {**labels, **rules[alert]["labels"]}, "exp_annotations": rules[alert]["annotations"]}
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": [expected]}],
            }
        )
    tests.append(
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in QUIET],
            "alert_rule_test": [{"eval_time": "35m", "alertname": a, "exp_alerts": []} for a in FIRING],
        }
    )
    test_file = tmp_path / "alerts-test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the GPU panels' joins, evaluated ------------------------------------------------------------


def panel_expr(title: str, ref: str = "A") -> str:
    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == title)
    return grafana_free(next(t["expr"] for t in panel["targets"] if t["refId"] == ref))


def dcgm(name: str, pod: str, node: str, gpu: str, values: str) -> tuple[str, str]:
    return f'{name}{{Hostname="{node}",gpu="{gpu}",namespace="llmstack",pod="{pod}"}}', values


# Pod w1 (node n1, 2 GPUs) serves m1; pod w2 (node n2, 1 GPU) serves m1 and m2; a GPU on n3 is held
# by no pod (the exporter's own pod name, as the scrape job labels it). Tenants a and b use m1 3:1;
# b alone uses m2; c only names a model the stack does not serve. Series start at 1m, so the hour
# before 60m holds exactly 60 one-minute samples.
GPU_PANEL_SERIES = [
    dcgm("DCGM_FI_DEV_FB_USED", "w1", "n1", "0", "_ 1000x59"),
    dcgm("DCGM_FI_DEV_FB_USED", "w1", "n1", "1", "_ 1000x59"),
    dcgm("DCGM_FI_DEV_FB_USED", "w2", "n2", "0", "_ 3000x59"),
    dcgm("DCGM_FI_DEV_FB_USED", "llmstack-dcgm-exporter-x", "n3", "0", "_ 10x59"),
    dcgm("DCGM_FI_DEV_GPU_UTIL", "w1", "n1", "0", "_ 80x59"),
    dcgm("DCGM_FI_DEV_GPU_UTIL", "w1", "n1", "1", "_ 60x59"),
    dcgm("DCGM_FI_DEV_GPU_UTIL", "w2", "n2", "0", "_ 40x59"),
    dcgm("DCGM_FI_DEV_GPU_UTIL", "llmstack-dcgm-exporter-x", "n3", "0", "_ 0x59"),
    dcgm("DCGM_FI_DEV_POWER_USAGE", "w1", "n1", "0", "_ 70x59"),
    dcgm("DCGM_FI_DEV_POWER_USAGE", "w1", "n1", "1", "_ 70x59"),
    dcgm("DCGM_FI_DEV_POWER_USAGE", "w2", "n2", "0", "_ 100x59"),
    ('DCGM_EXP_XID_ERRORS_COUNT{Hostname="n2",gpu="0",namespace="llmstack",pod="w2",xid="13"}', "_ 1x59"),
    ('ray_vllm_kv_cache_usage_perc{model_name="m1",pod="w1",WorkerId="1"}', "_ 0.5x59"),
    ('ray_vllm_kv_cache_usage_perc{model_name="m1",pod="w1",WorkerId="2"}', "_ 0.5x59"),
    ('ray_vllm_kv_cache_usage_perc{model_name="m1",pod="w2",WorkerId="3"}', "_ 0.5x59"),
    ('ray_vllm_kv_cache_usage_perc{model_name="m2",pod="w2",WorkerId="4"}', "_ 0.5x59"),
    ('llmstack_gateway_tokens_total{kind="prompt",model="m1",tenant="a"}', "_ 0+2x59"),
    ('llmstack_gateway_tokens_total{kind="completion",model="m1",tenant="a"}', "_ 0+1x59"),
    ('llmstack_gateway_tokens_total{kind="prompt",model="m1",tenant="b"}', "_ 0+1x59"),
    ('llmstack_gateway_tokens_total{kind="prompt",model="m2",tenant="b"}', "_ 0+2x59"),
    ('llmstack_gateway_tokens_total{kind="prompt",model="other",tenant="c"}', "_ 0+5x59"),
]
# panel -> samples at 60m. m1 holds w1's 2 GPUs and half of w2's; m2 the other half. a has 3/4 of
# m1 (2.5 GPU-hours in the hour); b 1/4 of m1 and all of m2.
GPU_PANELS = {
    "GPUs held per model": {'{model_name="m1"}': 2.5, '{model_name="m2"}': 0.5},
    "GPU utilisation per model": {'{model_name="m1"}': 55, '{model_name="m2"}': 40},  # pods 70 and 40
    "GPU power per model": {'{model_name="m1"}': 190, '{model_name="m2"}': 50},
    "GPU memory per model (used and free)": {'{model_name="m1"}': 3500 * 2**20, '{model_name="m2"}': 1500 * 2**20},
    "XID errors per model": {'{model_name="m1"}': 1, '{model_name="m2"}': 1},  # w2's XID concerns both
    "GPUs used per tenant (GPU-hours per hour)": {'{tenant="a"}': 1.875, '{tenant="b"}': 1.125},
    "GPU-hours per tenant (dashboard time range)": {'{tenant="a"}': 1.875, '{tenant="b"}': 1.125},
}


@needs_promtool
@pytest.mark.parametrize("title", GPU_PANELS)
def test_gpu_panels_join_gpus_to_models_and_tenants(title, tmp_path):
    # Rounded to 1/1024 (exact in binary), so float noise from the token shares cannot fail the test.
    expr = f"round({panel_expr(title)}, 0.0009765625)"
    samples = [{"labels": labels, "value": value} for labels, value in GPU_PANELS[title].items()]
    test = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in GPU_PANEL_SERIES],
        "promql_expr_test": [{"expr": expr, "eval_time": "60m", "exp_samples": samples}],
    }
    test_file = tmp_path / "panels-test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [test]}))
    result = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
