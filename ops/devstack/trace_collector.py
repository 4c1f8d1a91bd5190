"""A local OTLP/HTTP trace receiver for `make dev TRACE=1` and the e2e tests: no collector binary
is installable here (PyPI has none; the OpenTelemetry Collector ships as Go builds), so spans
are received in process and kept as JSON lines, one per span, in a file `llmctl trace` reads.

It speaks only what the stack's exporters send: OTLP over HTTP, protobuf bodies, POST
/v1/traces (the gateway's, Ray Serve's (serving.tracing_export) and vLLM's exporters, the last
with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf). Decoding uses OpenTelemetry's own
protobuf classes (opentelemetry-proto); a body that does not decode gets 400.

`trace_tree` prints one trace as an indented tree: each span's service, name, start offset
from the trace's first span, duration and the attributes worth reading.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ops.harness.processes import free_port

TRACES_PATH = "/v1/traces"
MAX_BODY_BYTES = 16 * 1024 * 1024
# Attributes `trace_tree` shows beside a span's name: who called, what was refused, and the
# engine's own timings (vLLM's gen_ai.latency.* and usage).
SHOWN_ATTRIBUTES = (
    "llmstack.tenant",
    "llmstack.key_id",
    "llmstack.model",
    "llmstack.tier",
    "http.response.status_code",
    "llmstack.refusal.code",
    "deployment",
    "replica_id",
    "gen_ai.latency.time_in_queue",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.latency.time_in_model_prefill",
    "gen_ai.latency.time_in_model_decode",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
)


@dataclass(frozen=True)
class SpanRecord:
    """One received span, as stored (one JSON line)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def decode_export(body: bytes) -> list[SpanRecord]:
    """The spans of one OTLP ExportTraceServiceRequest (protobuf)."""

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    records = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", "unknown"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        service=service,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                    )
                )
    return records


def _attributes(pairs: Iterable[Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        value = getattr(pair.value, kind) if kind else None
        values[pair.key] = value if isinstance(value, str | int | float | bool) or value is None else str(value)
    return values


class SpanFile:
    """Spans as JSON lines in `path`: appended by the receiver, read by `llmctl trace` and tests."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def append(self, records: list[SpanRecord]) -> None:
        lines = "".join(json.dumps(record.__dict__) + "\n" for record in records)
        with self._lock, self.path.open("a") as out:
            out.write(lines)

    def spans(self) -> list[SpanRecord]:
        if not self.path.exists():
            return []
        with self._lock:
            text = self.path.read_text()
        return [SpanRecord(**json.loads(line)) for line in text.splitlines() if line.strip()]

    def trace(self, trace_id: str) -> list[SpanRecord]:
        return [span for span in self.spans() if span.trace_id == trace_id]


def _handler(store: SpanFile) -> type[BaseHTTPRequestHandler]:
    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("content-length") or 0)
            if self.path != TRACES_PATH or not 0 < length <= MAX_BODY_BYTES:
                self.send_error(404 if self.path != TRACES_PATH else 400)
                return
            try:
                records = decode_export(self.rfile.read(length))
            except DecodeError:  # not an OTLP export: the sender's bug, said as a 400
                self.send_error(400, "not an OTLP/protobuf ExportTraceServiceRequest")
                return
            store.append(records)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass  # one line per export would drown make dev's own progress lines

    return Receiver


@contextmanager
def trace_collector(path: Path) -> Iterator[str]:
    """Receive spans on a free loopback port until the block ends, appending them to `path`
    (emptied first). Yields the OTLP endpoint to give exporters (observability.tracing.otlp_endpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _handler(SpanFile(path)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def trace_tree(spans: list[SpanRecord]) -> str:
    """One trace as text: a line per span, children indented under their parent, in start order.
    A span whose parent was not received (not sampled there, or still batched) is shown at the top."""
    if not spans:
        return "(no spans)"
    ids = {span.span_id for span in spans}
    children: dict[str | None, list[SpanRecord]] = {}
    for span in spans:
        parent = span.parent_id if span.parent_id in ids else None
        children.setdefault(parent, []).append(span)
    origin = min(span.start_ns for span in spans)
    lines = [f"trace {spans[0].trace_id}"]

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            shown = " ".join(f"{k}={_short(span.attributes[k])}" for k in SHOWN_ATTRIBUTES if k in span.attributes)
            offset_ms = (span.start_ns - origin) / 1e6
            lines.append(
                f"{'  ' * depth}{span.service}: {span.name}  +{offset_ms:.1f} ms  {span.duration_ms:.1f} ms"
                + (f"  {shown}" if shown else "")
            )
            walk(span.span_id, depth + 1)

    walk(None, 1)
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
