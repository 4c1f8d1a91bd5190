"""How `llmctl cost` and `llmctl cost report` look: rich tables, CSV and JSON. Pure."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from rich.table import Table

from infra.plan.cost import ModelCost
from infra.plan.showback import Showback

CSV_COLUMNS = (
    "period_start",
    "period_end",
    "kind",
    "tenant",
    "key_id",
    "model",
    "node_group",
    "prompt_tokens",
    "completion_tokens",
    "requests",
    "usd",
)


def usd(value: Decimal | None, places: int = 2) -> str:
    return "-" if value is None else f"${value:,.{places}f}"


def _rate(value: Decimal | None, estimate: bool) -> str:
    return "-" if value is None else usd(value, 4) + (" est." if estimate else "")


def cost_table(stack: str, costs: list[ModelCost]) -> Table:
    table = Table(
        title=f"stack {stack}: cost per model (node prices us-east-1; $/1M tokens at full use of a replica)",
        title_justify="left",
    )
    for column in (
        "model",
        "node group",
        "$/node-hour",
        "replicas",
        "$/hour at min",
        "$/hour at max",
        "tok/s per replica (out / total)",
        "$/1M output",
        "$/1M total",
    ):
        table.add_column(column, justify="left" if column in ("model", "node group") else "right")
    for c in costs:
        estimate = c.throughput is not None and c.throughput.estimate
        price = (
            "-"
            if c.node_price is None
            else usd(c.node_price.usd_per_hour, 4) + (" spot" if c.node_price.source.name == "SPOT" else "")
        )
        tps = (
            "-"
            if c.throughput is None
            else (
                f"{c.throughput.output_tokens_per_s:,.0f} / {c.throughput.total_tokens_per_s:,.0f}"
                + (" est." if estimate else "")
            )
        )
        table.add_row(
            c.model_id,
            f"{c.node_group} ({c.capacity_type})",
            price,
            f"{c.min_replicas} - {c.max_replicas}",
            usd(c.usd_per_hour_at_min),
            usd(c.usd_per_hour_at_max),
            tps,
            _rate(c.usd_per_million_output_tokens, estimate),
            _rate(c.usd_per_million_total_tokens, estimate),
        )
    return table


def cost_notes(costs: list[ModelCost]) -> list[str]:
    lines = []
    for c in costs:
        if c.throughput is not None:
            kind = "ESTIMATE" if c.throughput.estimate else "measured"
            lines.append(f"{c.model_id}: throughput {kind}: {c.throughput.source}")
        lines += [f"{c.model_id}: {note}" for note in c.notes if "published estimate" not in note]
    return lines


def cost_json(stack: str, costs: list[ModelCost]) -> str:
    return json.dumps(
        {"stack": stack, "currency": "USD", "models": [c.model_dump(mode="json") for c in costs]}, indent=2
    )


def _period(start: datetime, end: datetime) -> str:
    return f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC"


def report_tables(stack: str, report: Showback, start: datetime, end: datetime) -> list[Table]:
    rows = Table(title=f"stack {stack}: showback {_period(start, end)}", title_justify="left")
    for column in ("tenant", "key", "model", "prompt tokens", "completion tokens", "requests", "USD"):
        rows.add_column(column, justify="left" if column in ("tenant", "key", "model") else "right")
    for row in sorted(report.rows, key=lambda r: (r.tenant is None, r.tenant or "", r.key_id or "", r.model)):
        who = row.tenant if row.tenant is not None else f"({row.kind})"
        rows.add_row(
            who,
            row.key_id or "",
            row.model or f"(group {row.node_group})",
            f"{row.prompt_tokens:,}",
            f"{row.completion_tokens:,}",
            f"{row.requests:,}",
            usd(row.usd),
        )
    rows.caption = (
        f"total {usd(report.total_usd)}, of which idle or unpriced {usd(report.idle_usd)}, "
        f"overhead (resumed streams, the platform's) {usd(report.overhead_usd)}"
    )
    tenants = Table(title="by tenant", title_justify="left")
    for column in ("tenant", "prompt tokens", "completion tokens", "USD", "share of total"):
        tenants.add_column(column, justify="left" if column == "tenant" else "right")
    for t in report.tenants:
        share = "-" if not report.total_usd else f"{t.usd / report.total_usd:.1%}"
        tenants.add_row(t.tenant, f"{t.prompt_tokens:,}", f"{t.completion_tokens:,}", usd(t.usd), share)
    if report.overhead_usd:
        tenants.add_row(
            "(overhead: resumed streams)",
            "",
            "",
            usd(report.overhead_usd),
            "-" if not report.total_usd else f"{report.overhead_usd / report.total_usd:.1%}",
        )
    tenants.add_row(
        "(idle or unpriced)",
        "",
        "",
        usd(report.idle_usd),
        "-" if not report.total_usd else f"{report.idle_usd / report.total_usd:.1%}",
    )
    models = Table(title="by model", title_justify="left")
    for column in ("model", "node group", "cost", "attributed", "of it overhead", "idle", "utilisation"):
        models.add_column(column, justify="left" if column in ("model", "node group") else "right")
    for m in report.models:
        models.add_row(
            m.model,
            m.node_group,
            usd(m.usd),
            usd(m.attributed_usd),
            usd(m.overhead_usd),
            usd(m.idle_usd),
            "-" if m.utilisation is None else f"{m.utilisation:.1%}",
        )
    groups = Table(title="node groups", title_justify="left")
    for column in ("node group", "node-hours", "$/node-hour", "cost", "hours from"):
        groups.add_column(column, justify="left" if column == "node group" else "right")
    for g in report.groups:
        groups.add_row(
            g.node_group,
            f"{g.node_hours:,.1f}",
            usd(g.usd_per_node_hour, 4),
            usd(g.usd),
            "plan (assumed)" if g.assumed_hours else "given",
        )
    return [rows, tenants, models, groups]


def report_json(stack: str, report: Showback, start: datetime, end: datetime) -> str:
    document: dict[str, Any] = {
        "stack": stack,
        "currency": "USD",
        "period_start": start.isoformat(),
        "period_end": end.isoformat(),
        **report.model_dump(mode="json"),
    }
    return json.dumps(document, indent=2)


def report_csv(report: Showback, start: datetime, end: datetime) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in report.rows:
        writer.writerow(
            [
                start.isoformat(),
                end.isoformat(),
                row.kind,
                row.tenant or "",
                row.key_id or "",
                row.model,
                row.node_group or "",
                row.prompt_tokens,
                row.completion_tokens,
                row.requests,
                f"{row.usd:.2f}",
            ]
        )
    return buffer.getvalue()
