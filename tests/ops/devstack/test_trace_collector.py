"""The local OTLP receiver of `make dev TRACE=1`: spans exported by OpenTelemetry's own OTLP/HTTP
exporter arrive in its file, decoded, and `llmctl trace` prints a trace as an indented tree;
what is not an OTLP export is refused."""

from __future__ import annotations

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import format_trace_id
from typer.testing import CliRunner

from ops.devstack.trace_collector import SpanFile, trace_collector
from ops.llmctl.main import app


def test_spans_from_an_otlp_exporter_arrive_and_print_as_a_tree(tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    with trace_collector(spans_file) as endpoint:
        provider = TracerProvider(resource=Resource.create({"service.name": "llmstack-gateway"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces")))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("POST /v1/chat/completions") as root:
            root.set_attribute("llmstack.tenant", "acme")
            with tracer.start_as_current_span("authenticate"):
                pass
            with tracer.start_as_current_span("upstream_connect"):
                with tracer.start_as_current_span("llm_request") as engine:
                    engine.set_attribute("gen_ai.latency.time_in_queue", 0.25)
        provider.shutdown()
        refused = httpx.post(endpoint + "/v1/traces", content=b"\xff not protobuf")
    assert refused.status_code == 400
    trace_id = format_trace_id(root.get_span_context().trace_id)
    stored = SpanFile(spans_file).trace(trace_id)
    assert sorted(s.name for s in stored) == [
        "POST /v1/chat/completions",
        "authenticate",
        "llm_request",
        "upstream_connect",
    ]
    result = CliRunner().invoke(app, ["trace", trace_id, "--file", str(spans_file)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"trace {trace_id}"
    assert lines[1].startswith("  llmstack-gateway: POST /v1/chat/completions") and "llmstack.tenant=acme" in lines[1]
    assert lines[2].startswith("    llmstack-gateway: authenticate")
    assert lines[3].startswith("    llmstack-gateway: upstream_connect")
    assert (
        lines[4].startswith("      llmstack-gateway: llm_request") and "gen_ai.latency.time_in_queue=0.2500" in lines[4]
    )
    missing = CliRunner().invoke(app, ["trace", "0" * 32, "--file", str(spans_file)])
    assert missing.exit_code == 1
