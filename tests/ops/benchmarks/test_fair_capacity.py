"""The adaptive-capacity benchmark's pure parts: the stack it runs (the same model with and
without adaptation), and the summaries it reports."""

from __future__ import annotations

from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.fair_capacity import (
    ADAPTIVE,
    FIXED,
    JAIN_STREAMS,
    gateway_ttfts,
    growth_summary,
    jain_index,
    stack_text,
    summarize,
)


def test_the_stack_serves_the_same_model_with_and_without_adaptation(tmp_path):
    path = tmp_path / "Pulumi.faircap.yaml"
    path.write_text(stack_text((PROJECT_ROOT / "Pulumi.local.yaml").read_text(), engine_priority=True))
    spec = load_stack(str(path))
    adaptive, fixed = (next(m for m in spec.models if m.id == name) for name in (ADAPTIVE, FIXED))
    assert adaptive.latency_target.adaptive and not fixed.latency_target.adaptive
    assert adaptive.source == fixed.source and adaptive.speculative_decoding == fixed.speculative_decoding
    assert adaptive.autoscaling == fixed.autoscaling
    assert spec.gateway.queue.engine_priority


def test_summaries_count_failures_and_split_the_growth_trace():
    ok = {"phase": "p", "tenant": "b", "status": 200, "ttft": 0.1, "output_tokens": 32, "queue_wait_ms": 0}
    failed = {"phase": "p", "tenant": "b", "status": 503}
    broken = {**ok, "error": "RemoteProtocolError"}
    summary = summarize([ok, ok, failed, broken], "p", "b", seconds=2)
    assert (summary["requests"], summary["failed"], summary["output_tokens_per_s"]) == (4, 2, 32.0)
    records = [
        {"phase": "growth", "sent": 100.5, "ttft": 0.05, "status": 200, "prompt_tokens": 40},
        {"phase": "growth", "sent": 104.5, "ttft": 0.5, "status": 200, "prompt_tokens": 400},
    ]
    trace = [{"t": 100.6, "slots": "64"}, {"t": 104.6, "slots": "32"}]
    grown = growth_summary(records, trace, start=100.0, phase_s=4)
    assert [(r["prompt"], r["capacity"], r["ttft_p90_ms"]) for r in grown["trace"]] == [
        ("short", "64", 50),
        ("short", None, None),
        ("long", "32", 500),
        ("long", None, None),
    ]
    assert grown["prompt_tokens_p50"] == {"short": 40, "long": 400}
    assert jain_index([1.0, 1.0]) == 1.0 and jain_index([1.0, 0.0]) == 0.5


def test_the_gateway_ttft_is_read_from_its_access_log_by_request_id():
    lines = [
        '{"event": "access", "request_id": "r1", "status": 200, "ttft_ms": 40.5}\n',
        "2026-12-05 INFO uvicorn.error: Started server process\n",
        '{"event": "access", "request_id": "r2", "status": 429, "ttft_ms": null}\n',
    ]
    at_gateway = gateway_ttfts(lines)
    assert at_gateway == {"r1": 40.5}
    ok = {"phase": "p", "tenant": "b", "status": 200, "ttft": 0.3, "request_id": "r1"}
    summary = summarize([ok], "p", "b", seconds=1, gateway_ttft=at_gateway)
    assert (summary["ttft_p99_ms"], summary["gateway_ttft_p99_ms"]) == (300, 40)


def test_one_address_may_open_every_connection_the_load_needs(tmp_path):
    path = tmp_path / "Pulumi.faircap.yaml"
    path.write_text(stack_text((PROJECT_ROOT / "Pulumi.local.yaml").read_text(), engine_priority=True))
    gateway = load_stack(str(path)).gateway
    assert gateway.edge.max_connections_per_client >= 4 * JAIN_STREAMS
    # Past max_connections uvicorn answers a plain-text 503: the load (plus tenant B and the
    # capacity trace's client) must stay under it.
    assert 4 * JAIN_STREAMS + 8 <= gateway.max_connections


def test_the_jain_load_keeps_every_tenant_above_its_share():
    ceiling, weights = 64, [1, 1, 2, 4]
    assert all(JAIN_STREAMS > ceiling * w / sum(weights) for w in weights)


def test_a_tighter_ttft_target_reaches_both_models(tmp_path):
    path = tmp_path / "Pulumi.faircap.yaml"
    path.write_text(stack_text((PROJECT_ROOT / "Pulumi.local.yaml").read_text(), engine_priority=True, ttft_ms=60))
    spec = load_stack(str(path))
    assert {m.id: m.latency_target.ttft_ms for m in spec.models} == {ADAPTIVE: 60, FIXED: 60}
