"""What `llmctl cost` reads from its options: bench files, given prices and node-hours, the
report's period. Each parser raises `CostInputError` with the option, the value and the fix."""

from __future__ import annotations

import json
import re
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from infra.catalog.throughput import Throughput
from infra.spec.schema import StackSpec
from serving.gateway.limits.budgets import month_window


class CostInputError(ValueError):
    """An unusable option; the message says which and how to fix it."""


class _BenchLevel(BaseModel):
    # The fields of `ops.llmctl.bench.stats.LevelSummary` a price needs (read without numpy,
    # which only `llmctl bench` itself needs).
    model_config = ConfigDict(extra="ignore")

    level: float
    requests: int
    ok: int
    output_throughput: float
    total_token_throughput: float


class _BenchFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    mode: str
    base_url: str
    started_at: str
    levels: list[_BenchLevel]


def read_bench(path: Path) -> _BenchFile:
    try:
        return _BenchFile.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise CostInputError(f"--bench {path}: cannot read it ({exc.strerror})") from None
    except (ValueError, ValidationError) as exc:
        raise CostInputError(
            f"--bench {path}: not an `llmctl bench --out` JSON report ({exc.__class__.__name__})"
        ) from None


def bench_throughput(report: _BenchFile, path: Path, *, level: float | None, replicas: int) -> Throughput:
    """Tokens/s of one replica from a bench report: the level asked for, else the level with the
    highest output throughput; divided by the replicas that served the bench."""
    usable = [lv for lv in report.levels if lv.ok > 0 and lv.output_throughput > 0]
    if not usable:
        raise CostInputError(f"--bench {path}: no level of the run had a successful request")
    if level is None:
        chosen = max(usable, key=lambda lv: lv.output_throughput)
        why = "highest output throughput"
    else:
        matches = [lv for lv in usable if lv.level == level]
        if not matches:
            levels = ", ".join(f"{lv.level:g}" for lv in usable)
            raise CostInputError(f"--concurrency {level:g}: {path} has no successful level {level:g}; it has {levels}")
        chosen, why = matches[0], "chosen"
    per_replica = Decimal(str(chosen.output_throughput)) / replicas
    total = Decimal(str(max(chosen.total_token_throughput, chosen.output_throughput))) / replicas
    unit = "concurrency" if report.mode == "concurrency" else "request rate"
    source = (
        f"llmctl bench {path.name} ({report.started_at}, {report.base_url}): {unit} {chosen.level:g} ({why}), "
        f"{chosen.ok}/{chosen.requests} ok" + (f", divided by {replicas} replicas" if replicas > 1 else "")
    )
    return Throughput(output_tokens_per_s=per_replica, total_tokens_per_s=total, estimate=False, source=source)


def bench_throughputs(
    spec: StackSpec, values: list[str], *, level: float | None, replicas: int
) -> dict[str, Throughput]:
    """Model id -> measured throughput, from `--bench FILE` (matched by the model the bench
    requested) or `--bench MODEL_ID=FILE`."""
    found: dict[str, Throughput] = {}
    for value in values:
        model_id, _, file = value.partition("=") if "=" in value else ("", "", value)
        path = Path(file)
        report = read_bench(path)
        if model_id:
            spec_model = next((m for m in spec.models if m.id == model_id), None)
            if spec_model is None:
                raise CostInputError(
                    f"--bench {value}: stack {spec.name} has no model {model_id!r}; models: "
                    f"{', '.join(m.id for m in spec.models)}"
                )
        else:
            spec_model = next((m for m in spec.models if report.model in (m.model_name, m.id)), None)
            if spec_model is None:
                raise CostInputError(
                    f"--bench {path}: it measured model {report.model!r}, which stack {spec.name} "
                    f"does not serve; name the model: --bench MODEL_ID={path} (models: "
                    f"{', '.join(m.id for m in spec.models)})"
                )
        if spec_model.id in found:
            raise CostInputError(f"--bench: two files for model {spec_model.id!r}; give one")
        found[spec_model.id] = bench_throughput(report, path, level=level, replicas=replicas)
    return found


def group_amounts(spec: StackSpec, values: list[str], option: str) -> dict[str, Decimal]:
    """`GROUP=AMOUNT` options (--usd-per-hour, --node-hours) by node group."""
    groups = {g.name for g in spec.node_groups}
    found: dict[str, Decimal] = {}
    for value in values:
        group, _, amount = value.partition("=")
        if group not in groups:
            raise CostInputError(
                f"{option} {value}: stack {spec.name} has no node group {group!r}; node groups: "
                f"{', '.join(sorted(groups))} (form: {option} GROUP=AMOUNT)"
            )
        try:
            number = Decimal(amount)
        except InvalidOperation:
            raise CostInputError(
                f"{option} {value}: {amount!r} is not a number (form: {option} GROUP=AMOUNT)"
            ) from None
        if not number.is_finite() or number < 0:
            raise CostInputError(f"{option} {value}: give a number >= 0")
        found[group] = number
    return found


_SINCE = re.compile(r"^(\d+)d$")


def report_window(since: str | None, month: str | None, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the report. `--since Nd`: the last N UTC days, today (so far) included.
    `--month YYYY-MM`: that calendar month, up to now if it is the current one."""
    if since and month:
        raise CostInputError("give --since or --month, not both")
    if month:
        try:
            start, end = month_window(month)
        except ValueError as exc:
            raise CostInputError(f"--month: {exc}") from None
        if start > now:
            raise CostInputError(f"--month {month} has not started yet")
        return start, min(end, now)
    match = _SINCE.match(since or "30d")
    if not match or int(match[1]) < 1:
        raise CostInputError(f"--since {since!r}: give whole days, e.g. --since 30d")
    today = datetime.combine(now.astimezone(UTC).date(), datetime.min.time(), tzinfo=UTC)
    return today - timedelta(days=int(match[1]) - 1), now


def days_in(start: datetime, end: datetime) -> list[date]:
    """The UTC days [start, end) touches."""
    first, last = start.date(), (end - timedelta(microseconds=1)).date()
    return [first + timedelta(days=n) for n in range((last - first).days + 1)]
