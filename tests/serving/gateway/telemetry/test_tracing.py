"""One trace per request, through real gateway processes in front of a recording upstream, with
the SDK's in-memory exporter: the request's root span, a child span per stage the request ran,
the trace context the upstream receives, refusals traced with their code, the access line's
trace id, and nothing at all when tracing is off."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.config.tracing_policy import TracingPolicy
from serving.gateway.telemetry import tracing
from tests.support.waiting import eventually

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a secret prompt"}]}
TRACED = {"tracing": {"otlp_endpoint": "http://127.0.0.1:9", "sampling_ratio": 1.0}}
CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(TracingPolicy(otlp_endpoint="http://127.0.0.1:9", sampling_ratio=1.0), provider)
    try:
        yield exporter
    finally:
        tracing.uninstall()


@pytest.fixture(scope="module")
def traced_gateway(start_gateway) -> Iterator[str]:
    with start_gateway(forward_request_headers=["traceparent"], **TRACED) as (api, _):
        yield api


def request_traces(exporter: InMemorySpanExporter, requests: int = 1) -> dict[int, list[ReadableSpan]]:
    """Spans by trace, once `requests` root spans have ended (a root ends after its last byte is
    sent, so just after the client has its answer)."""
    eventually(
        lambda: sum(span.parent is None for span in exporter.get_finished_spans()) >= requests or None,
        f"{requests} request spans",
    )
    traces: dict[int, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        traces.setdefault(span.context.trace_id, []).append(span)
    return traces


def root_of(trace: list[ReadableSpan]) -> ReadableSpan:
    (root,) = [span for span in trace if span.parent is None]
    return root


def test_a_request_is_one_trace_with_a_span_per_stage(traced_gateway, recorded, key, spans):
    response = httpx.post(
        f"{traced_gateway}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {key}", "traceparent": CLIENT_TRACEPARENT},
    )
    assert response.status_code == 200
    (trace,) = request_traces(spans).values()
    root = root_of(trace)
    assert root.name == "POST /v1/chat/completions"
    assert root.attributes is not None
    assert root.attributes["llmstack.tenant"] == "acme"
    assert root.attributes["llmstack.key_id"] == key.removeprefix("sk-llm-").split("_")[0]
    assert root.attributes["llmstack.model"] == "tiny"
    assert root.attributes["llmstack.tier"] == "standard"
    assert root.attributes["http.response.status_code"] == 200
    stages = [span.name for span in sorted(trace, key=lambda span: span.start_time or 0) if span is not root]
    assert stages == [
        "route",
        "authenticate",
        "read_body",
        "validate",
        "reserve",
        "limit",
        "queue_wait",
        "upstream_connect",
        "relay",
        "settle",  # inside the relay: it settles before the client gets the last bytes
        "log",
    ]
    # The caller's trace is not joined: the gateway starts its own, and sends its own upstream.
    assert format_trace_id(root.context.trace_id) != CLIENT_TRACEPARENT.split("-")[1]
    upstream_connect = next(span for span in trace if span.name == "upstream_connect")
    (seen,) = recorded.seen
    version, trace_id, parent_id, flags = seen.headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled (the SDK also sets W3C's random-id bit)
    assert trace_id == format_trace_id(root.context.trace_id)
    assert parent_id == format_span_id(upstream_connect.context.span_id)
    # Nothing of the prompt or the key in any span.
    for span in trace:
        for value in (span.attributes or {}).values():
            assert "secret prompt" not in str(value) and key not in str(value)


@pytest.mark.parametrize(
    ("status", "code", "call"),
    [
        (
            401,
            "invalid_api_key",
            lambda api, key: httpx.post(
                f"{api}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-llm-nobody_guessed"}
            ),
        ),
        (404, "unknown_url", lambda api, key: httpx.get(f"{api}/v1/nothing-here", headers={"Authorization": key})),
        (
            400,
            "unknown_parameter",
            lambda api, key: httpx.post(
                f"{api}/v1/chat/completions", json={**CHAT, "top_k": 3}, headers={"Authorization": f"Bearer {key}"}
            ),
        ),
    ],
)
def test_a_refused_request_still_has_its_trace(traced_gateway, recorded, key, spans, status, code, call):
    response = call(traced_gateway, key)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    (trace,) = request_traces(spans).values()
    root = root_of(trace)
    assert root.attributes is not None
    assert root.attributes["http.response.status_code"] == status
    assert root.attributes["llmstack.refusal.code"] == code
    assert recorded.seen == []  # refused before the upstream


def test_a_request_over_its_limit_is_traced_with_the_limit_stage(traced_gateway, recorded, redis_server, spans):
    one_a_minute = create_key_sync(
        redis_server.url,
        "acme",
        "slow",
        limits={
            "requests_per_minute": 1,
            "tokens_per_minute": 10**6,
            "daily_token_budget": 10**9,
            "max_concurrent_requests": 4,
        },
    )
    headers = {"Authorization": f"Bearer {one_a_minute}"}
    statuses = [httpx.post(f"{traced_gateway}/v1/chat/completions", json=CHAT, headers=headers).status_code]
    statuses.append(httpx.post(f"{traced_gateway}/v1/chat/completions", json=CHAT, headers=headers).status_code)
    assert statuses == [200, 429]
    traces = request_traces(spans, requests=2)
    refused = [root_of(t) for t in traces.values() if root_of(t).attributes["http.response.status_code"] == 429]
    (root,) = refused
    assert root.attributes is not None and root.attributes["llmstack.refusal.code"] == "rate_limit_exceeded"
    trace = traces[root.context.trace_id]
    assert {"authenticate", "limit"} <= {span.name for span in trace}
    assert "upstream_connect" not in {span.name for span in trace}


def test_the_access_line_carries_the_trace_id(traced_gateway, recorded, key, spans, access_lines):
    httpx.post(f"{traced_gateway}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    (trace,) = request_traces(spans).values()
    line = [line for line in access_lines.lines if line.get("path") == "/v1/chat/completions"][-1]
    assert line["trace_id"] == format_trace_id(root_of(trace).context.trace_id)


def test_an_unsampled_request_makes_no_span_but_tells_the_upstream(start_gateway, recorded, key):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing_sampler(0.0))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(TracingPolicy(otlp_endpoint="http://127.0.0.1:9", sampling_ratio=0.0), provider)
    try:
        with start_gateway(**TRACED) as (api, _):
            response = httpx.post(f"{api}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    finally:
        tracing.uninstall()
    assert response.status_code == 200
    assert exporter.get_finished_spans() == ()
    (seen,) = recorded.seen
    flags = seen.headers["traceparent"].rsplit("-", 1)[1]
    assert not int(flags, 16) & 1  # not sampled: Serve and vLLM record nothing for it either


def test_tracing_off_sends_no_trace_context(gateway, recorded, key, access_lines):
    assert not tracing.enabled()
    httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    (seen,) = recorded.seen
    assert "traceparent" not in seen.headers
    # logged once the response has ended, which may be just after the client has it
    lines = eventually(
        lambda: [line for line in access_lines.lines if line.get("path") == "/v1/chat/completions"], "the access line"
    )
    assert "trace_id" not in lines[-1]


def tracing_sampler(ratio: float):
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return ParentBased(TraceIdRatioBased(ratio))
