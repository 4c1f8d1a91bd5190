"""Where Ray Serve's spans go: the exporter function Serve's `tracing_config.exporter_import_path`
names (Ray 2.60 ray/serve/_private/tracing_utils.py `_load_span_processors`: a function of no
arguments returning span processors, called in every replica and proxy).

It takes no arguments, so the collector's address comes from the environment every Ray process
of the stack gets (`infra.render.serve_config.serving_env`): OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
which OTel's OTLP/HTTP exporter reads itself. vLLM, in the same replica process, reads the same
variables (vllm/tracing/otel.py), so Serve's and the engine's spans go to one collector.
"""

from __future__ import annotations

from typing import Any


def otlp_span_processors() -> list[Any]:
    """Spans batched off the request path to the OTLP/HTTP collector named by the environment."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return [BatchSpanProcessor(OTLPSpanExporter())]
