"""The adaptive-capacity benchmark's pure parts: the stack it runs (the same model with and
without adaptation), and the summaries it reports."""

from __future__ import annotations

from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.fair_capacity import (
    ADAPTIVE,
    FIXED,
    JAIN_STREAMS,
    backlog_summary,
    client_keeps_up,
    gateway_times,
    gateway_ttfts,
    growth_summary,
    jain_index,
    stack_text,
    steady_records,
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
        {"phase": "growth", "sent": 100.5, "ttft": 0.05, "status": 200, "prompt_tokens": 40, "request_id": "r1"},
        {"phase": "growth", "sent": 104.5, "ttft": 0.5, "status": 200, "prompt_tokens": 400, "queue_wait_ms": 90},
        {"phase": "growth", "sent": 108.5, "ttft": 0.06, "status": 200, "prompt_tokens": 40},
    ]
    trace = [{"t": 100.6, "slots": "64", "move": "up", "in_flight": 30}, {"t": 104.6, "slots": "32", "move": "down"}]
    grown = growth_summary(
        records, trace, start=100.0, phase_s=4, stages=["short", "long", "short"], gateway_ttft={"r1": 20.0}
    )
    rows = [(r["prompt"], r["capacity"], r["move"], r["ttft_p90_ms"], r["gateway_ttft_p90_ms"]) for r in grown["trace"]]
    assert rows == [
        ("short", "64", "up", 50, 20),
        ("short", None, None, None, None),
        ("long", "32", "down", 500, None),
        ("long", None, None, None, None),
        ("short", None, None, 60, None),
        ("short", None, None, None, None),
    ]
    assert grown["trace"][0]["in_flight_max"] == 30 and grown["trace"][2]["queue_wait_p90_ms"] == 90
    assert grown["prompt_tokens_p50"] == [40, 400, 40]
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
    # --jain-streams 192 (each tenant above its share at a second per request outside the gateway)
    assert 4 * 192 + 8 <= min(gateway.max_connections, gateway.edge.max_connections_per_client)
    # and every one of them may wait in the queue without pushing another tenant's out (a 429)
    standard = next(tier for tier in gateway.queue.tiers if tier.name == gateway.queue.default_tier)
    assert standard.max_queue_length >= 4 * 192


def test_the_jain_load_keeps_every_tenant_above_its_share():
    ceiling, weights = 64, [1, 1, 2, 4]
    assert all(JAIN_STREAMS > ceiling * w / sum(weights) for w in weights)


def test_a_tighter_ttft_target_reaches_both_models(tmp_path):
    path = tmp_path / "Pulumi.faircap.yaml"
    path.write_text(stack_text((PROJECT_ROOT / "Pulumi.local.yaml").read_text(), engine_priority=True, ttft_ms=60))
    spec = load_stack(str(path))
    assert {m.id: m.latency_target.ttft_ms for m in spec.models} == {ADAPTIVE: 60, FIXED: 60}


def test_the_jain_figures_leave_out_the_ramp_and_say_who_was_backlogged():
    records = [
        {"phase": "jain", "tenant": "w4", "sent": 100.0, "done": 104.0, "status": 200},  # admitted in the ramp
        {"phase": "jain", "tenant": "w4", "sent": 103.0, "done": 104.0, "status": 200},
        {"phase": "jain", "tenant": "w4", "sent": 109.0, "done": 112.0, "status": 200},  # ends after the phase
        {"phase": "jain", "tenant": "w4", "sent": 110.0, "done": 111.0, "status": 200},  # the loop had stopped
        {"phase": "growth", "tenant": "g", "sent": 105.0, "done": 106.0, "status": 200},
    ]
    steady = steady_records(records, "jain", start=100.0, end=110.0)
    assert [r["sent"] for r in steady] == [103.0, 109.0] and {r["phase"] for r in steady} == {"jain:steady"}
    samples = [
        {"held": {"w4": 3, "w1a": 1}, "waiting": {"w1a": 5}},
        {"held": {"w4": 5}, "waiting": {"w1a": 7, "w4": 2}},
    ]
    assert backlog_summary(samples, ["w1a", "w4"]) == {
        "w1a": {"held_mean": 0.5, "waiting_mean": 6.0, "none_waiting": 0.0},
        "w4": {"held_mean": 4.0, "waiting_mean": 1.0, "none_waiting": 0.5},
    }


def test_where_a_request_s_time_went_client_gateway_and_queue():
    lines = ['{"event": "access", "request_id": "r1", "status": 200, "latency_ms": 900.0, "ttft_ms": 40.5}\n']
    ok = {
        "phase": "p",
        "tenant": "b",
        "status": 200,
        "request_id": "r1",
        "sent": 1.0,
        "done": 2.0,
        "queue_wait_ms": 300,
    }
    summary = summarize([ok], "p", "b", seconds=1, gateway_latency=gateway_times(lines, "latency_ms"))
    assert (summary["client_latency_mean_ms"], summary["gateway_latency_mean_ms"], summary["queue_wait_mean_ms"]) == (
        1000,
        900,
        300,
    )


def test_the_client_s_latency_is_put_beside_the_gateway_s():
    tenants = {
        "w1a": {"client_latency_mean_ms": 6800, "gateway_latency_mean_ms": 2000},
        "w4": {"client_latency_mean_ms": 2100, "gateway_latency_mean_ms": 2000},
        "idle": {"client_latency_mean_ms": None, "gateway_latency_mean_ms": None},  # no request timed
    }
    assert client_keeps_up(tenants) == {"w1a": "6800 / 2000 ms (3.40x)", "w4": "2100 / 2000 ms (1.05x)", "idle": None}
