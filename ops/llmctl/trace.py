"""`llmctl trace ID`: one request's trace as an indented tree, from the spans `make dev TRACE=1`
received (ops.devstack.trace_collector). The id is the access line's `trace_id`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ops.devstack.runner import TRACE_FILE
from ops.devstack.trace_collector import SpanFile, trace_tree
from ops.llmctl.console import fail, out
from ops.paths import state_dir


def trace(
    trace_id: Annotated[str, typer.Argument(help="32 hex digits: the access line's trace_id.")],
    spans_file: Annotated[
        Path | None, typer.Option("--file", help="JSON-lines spans (default: make dev's, in the state folder).")
    ] = None,
) -> None:
    """Print one request's trace: gateway stages, Serve's replica span, vLLM's engine span."""
    path = spans_file or state_dir() / TRACE_FILE
    spans = SpanFile(path).trace(trace_id.lower())
    if not spans:
        raise fail(f"no spans of trace {trace_id} in {path} (make dev TRACE=1 writes them; they arrive within ~5 s)")
    out.print(trace_tree(spans), markup=False, highlight=False, soft_wrap=True)
