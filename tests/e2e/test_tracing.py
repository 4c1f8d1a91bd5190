"""One trace per request from the gateway into the engine, on the shared dev stack (which runs as
`make dev TRACE=1`: every request sampled, spans received in process into its state folder).

For 100 chat completions through the official client, streamed and not: each request (found by
the gateway's x-request-id) has exactly one trace; the gateway's stage spans cover at least 95%
of the gateway's own span, by named stage; the trace reaches Ray Serve (the replica's span) and
the engine (vLLM's `llm_request`, with its queue, prefill and decode times); the access line
names the trace. A request refused at each kind of stage (401, 400, 429, 404) has its trace too,
with the refusal's code.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from ops.devstack.trace_collector import SpanFile, SpanRecord, trace_tree
from serving.gateway.telemetry.tracing import SERVICE_NAME, STAGES
from tests.support.waiting import eventually

MODEL = "tiny-chat"
REQUESTS = 100
COVERAGE = 0.95
ENGINE_SPAN = "llm_request"  # vLLM's span per request (vllm/v1/engine/output_processor.py do_tracing)
SERVE_SPAN = "replica_handle_request"  # Ray Serve's (ray/serve/_private/replica.py _tracing_context)


def roots_by_request_id(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    roots: dict[str, list[SpanRecord]] = {}
    for span in spans:
        request_id = span.attributes.get("llmstack.request_id")
        if span.parent_id is None and span.service == SERVICE_NAME and request_id:
            roots.setdefault(str(request_id), []).append(span)
    return roots


def stage_coverage(root: SpanRecord, trace: list[SpanRecord]) -> tuple[float, list[tuple[str, float]]]:
    """The share of the request span's time its stage spans cover (their union), and the
    uncovered gaps over 0.1 ms as (between which stages, ms), for a failure to name."""
    stages = sorted((s for s in trace if s.parent_id == root.span_id and s.name in STAGES), key=lambda s: s.start_ns)
    covered, reached, before, gaps = 0, root.start_ns, "start", []
    for stage in stages:
        start, end = max(stage.start_ns, reached), min(stage.end_ns, root.end_ns)
        if start - reached > 100_000:
            gaps.append((f"{before} -> {stage.name}", (start - reached) / 1e6))
        if end > start:
            covered += end - start
            reached = end
        before = stage.name if end >= reached else before
    if root.end_ns - reached > 100_000:
        gaps.append((f"{before} -> end", (root.end_ns - reached) / 1e6))
    return covered / (root.end_ns - root.start_ns), gaps


def test_every_request_is_one_trace_from_the_gateway_into_the_engine(dev_stack, dev_client):
    request_ids = []
    for i in range(REQUESTS):
        messages = [{"role": "user", "content": f"count to {i}"}]
        if i % 2:
            raw = dev_client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
            raw.parse()
        else:
            with dev_client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True
            ) as raw:
                for _ in raw.iter_lines():
                    pass
        request_ids.append(raw.headers["x-request-id"])
    spans = SpanFile(dev_stack.spans_file)

    def all_engine_spans() -> dict[str, list[SpanRecord]] | None:
        every = spans.spans()
        roots = roots_by_request_id(every)
        if not all(rid in roots for rid in request_ids):
            return None
        by_trace: dict[str, list[SpanRecord]] = {}
        for span in every:
            by_trace.setdefault(span.trace_id, []).append(span)
        traces = {rid: by_trace[roots[rid][0].trace_id] for rid in request_ids}
        # Serve's replica and vLLM export their spans in batches of their own: wait for both.
        done = all(
            ENGINE_SPAN in (names := {s.name for s in t}) and any(n.startswith(SERVE_SPAN) for n in names)
            for t in traces.values()
        )
        return traces if done else None

    # Spans leave each process in batches (every 5 s by default): wait for the engine's last ones.
    traces = eventually(all_engine_spans, "every request's spans, Serve's and the engine's included")
    roots = roots_by_request_id(spans.spans())
    coverages = []
    for request_id in request_ids:
        assert len(roots[request_id]) == 1, f"request {request_id} has {len(roots[request_id])} traces"
        root, trace = roots[request_id][0], traces[request_id]
        assert root.attributes["http.response.status_code"] == 200
        assert root.attributes["llmstack.model"] == MODEL and root.attributes["llmstack.tenant"] == "dev"
        names = {s.name for s in trace}
        assert {"authenticate", "read_body", "limit", "upstream_connect", "relay", "settle"} <= names
        assert any(name.startswith(SERVE_SPAN) for name in names), sorted(names)
        engine = next(s for s in trace if s.name == ENGINE_SPAN)
        for timing in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"):
            assert engine.attributes[f"gen_ai.latency.{timing}"] >= 0
        assert engine.attributes["gen_ai.usage.completion_tokens"] >= 1
        coverages.append((*stage_coverage(root, trace), request_id, root.duration_ms))
    worst, gaps, request_id, duration_ms = min(coverages)
    assert COVERAGE <= worst <= 1.0, (
        f"stage spans cover {worst:.3f} of request {request_id}'s {duration_ms:.1f} ms in the gateway; "
        f"uncovered: {gaps} (load {os.getloadavg()[0]:.0f})"
    )
    # The access line names the trace, so an operator goes from "my request was slow" to its trace.
    access = [json.loads(line) for line in dev_stack.stderr if line.startswith('{"event": "access"')]
    traced = {line["request_id"]: line.get("trace_id") for line in access}
    assert all(traced.get(rid) == roots[rid][0].trace_id for rid in request_ids)
    print(trace_tree(traces[request_ids[1]]))  # one, for the report


@pytest.mark.parametrize("status", [401, 400, 429, 404])
def test_a_refused_request_has_its_trace(dev_stack, dev_client, status):
    from serving.gateway.auth.keys import create_key_sync

    messages = [{"role": "user", "content": "hi"}]
    client = dev_client
    if status == 401:
        client = dev_client.with_options(api_key="sk-llm-nobody_guessed")
    if status == 429:
        key = create_key_sync(
            dev_stack.ready["redis_url"], tenant="trace-test", name="one-a-minute", limits={"requests_per_minute": 1}
        )
        client = dev_client.with_options(api_key=key)
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    with pytest.raises(openai.APIStatusError) as refused:
        if status == 404:
            client.models.retrieve("no-such-model")
        elif status == 400:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"top_k": 2})
        else:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert refused.value.status_code == status
    request_id = refused.value.response.headers["x-request-id"]
    spans = SpanFile(dev_stack.spans_file)
    (root,) = eventually(lambda: roots_by_request_id(spans.spans()).get(request_id), f"the {status}'s trace")
    assert root.attributes["http.response.status_code"] == status
    assert root.attributes["llmstack.refusal.code"] == refused.value.code or refused.value.code is None
    assert "llmstack.refusal.code" in root.attributes
