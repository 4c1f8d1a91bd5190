"""`llmctl bench --adapters`: LoRA adapters on one base model, what their users pay for them.

1. Cold load, per adapter: the first request that names `<model>:<adapter>` (the replica downloads
   the adapter and vLLM loads it into a slot) against the next one to the same adapter (warm),
   both a one-token answer to the same prompt, so the difference is the load. An adapter a replica
   already holds (a second run against the same stack) measures warm twice: restart the stack
   for cold figures. Reported per adapter and as p50/p95 over the adapters.
2. Warm throughput per adapter mix: the same requests (the prompts and lengths `llmctl bench`
   draws from --seed) at one concurrency, first to the base alone, then spread round-robin over
   the adapters, then over the base and the adapters; output tokens/s of each and its ratio to
   the base alone's, measured in the same run. Every failed request is counted, by type.

Requests are `ops.llmctl.bench.loadgen.one_request` (the official openai client, streamed, no
retries) and each mix is summarised by `ops.llmctl.bench.stats.summarise`, like a level of
`llmctl bench`. The measuring functions take a client; the summaries are pure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import numpy as np
import openai
from pydantic import BaseModel, Field
from rich.table import Table

from ops.llmctl.bench.loadgen import LoadSpec, make_client, one_request, request_plan
from ops.llmctl.bench.stats import LevelSummary, RequestResult, summarise

COLD_PROMPT = "Write a query that lists every customer and their orders."
BASE, ADAPTERS, BASE_AND_ADAPTERS = "base", "adapters", "base+adapters"


class ColdLoad(BaseModel):
    """One adapter's first request against its next (one output token each)."""

    adapter: str = Field(description="The model name requested, `<model>:<adapter>`.")
    first_ms: float | None = Field(description="End-to-end time of the first request naming it; None: it failed.")
    warm_ms: float | None = Field(description="The next request's, the adapter loaded; None: it failed.")
    load_ms: float | None = Field(description="first_ms - warm_ms: the load; None when either failed.")
    error: str | None = Field(default=None, description="The first failure's type, e.g. `NotFoundError (404)`.")


class MixThroughput(BaseModel):
    """One adapter mix's warm run, and its throughput against the base alone's in the same run."""

    mix: str = Field(description="`base`, `adapters` (round-robin over them) or `base+adapters`.")
    models: list[str] = Field(description="Model names the requests cycle through, in order.")
    summary: LevelSummary = Field(description="As a level of `llmctl bench` reports it.")
    vs_base: float | None = Field(description="Output tokens/s over the base alone's; None without a base figure.")


class AdapterBenchReport(BaseModel):
    """The JSON `llmctl bench --adapters` writes."""

    command: str = Field(description="The command line that produced this report.")
    started_at: str = Field(description="UTC time the run started (ISO 8601).")
    base_url: str = Field(description="Endpoint measured.")
    model: str = Field(description="The base model.")
    adapters: list[str] = Field(description="Adapter ids, as given.")
    concurrency: int = Field(description="Requests in flight during each mix.")
    requests_per_mix: int = Field(description="Requests each mix sends.")
    prompt_tokens: str = Field(description="Prompt length distribution of the mixes (words).")
    output_tokens: str = Field(description="max_tokens distribution of the mixes.")
    seed: int = Field(description="Seed of the mixes' prompts and lengths (the same for every mix).")
    cold_loads: list[ColdLoad] = Field(description="One per adapter, in the order given.")
    cold_load_p50_ms: float | None = Field(description="Median load_ms over the adapters that loaded.")
    cold_load_p95_ms: float | None = Field(description="95th percentile of load_ms (numpy's linear interpolation).")
    mixes: list[MixThroughput] = Field(description="base, adapters, base+adapters, in the order run.")
    failed: int = Field(description="Requests that failed, cold loads and mixes together.")


# --- pure ---------------------------------------------------------------------------------------


def adapter_names(model: str, adapters: Sequence[str]) -> list[str]:
    """`<model>:<adapter>` as clients (and Ray Serve LLM's router) name an adapter."""
    return [f"{model}:{a}" for a in adapters]


def adapter_mixes(model: str, adapters: Sequence[str]) -> dict[str, list[str]]:
    """The mixes measured, in order: the base alone first, the baseline of the ratios."""
    names = adapter_names(model, adapters)
    return {BASE: [model], ADAPTERS: names, BASE_AND_ADAPTERS: [model, *names]}


def parse_adapters(text: str) -> list[str]:
    """`sql,pirate` -> ["sql", "pirate"]; each once, none empty."""
    adapters = [a.strip() for a in text.split(",")]
    if not all(adapters):
        raise ValueError(f"--adapters {text!r}: give adapter ids separated by commas, e.g. sql,pirate")
    twice = sorted({a for a in adapters if adapters.count(a) > 1})
    if twice:
        raise ValueError(f"--adapters {text!r}: {', '.join(twice)} given twice")
    return adapters


def served(result: RequestResult) -> bool:
    """A cold-load request was answered: no error, or a one-token answer whose token decoded to no
    text (a byte piece of a character: `NoOutput` to the load generator) with its usage chunk."""
    return result.error is None or (result.error == "NoOutput" and result.output_tokens > 0)


def cold_load(adapter: str, first: RequestResult, warm: RequestResult) -> ColdLoad:
    def ms(result: RequestResult) -> float | None:
        return round((result.end - result.start) * 1000, 3) if served(result) else None

    first_ms, warm_ms = ms(first), ms(warm)
    load = None if first_ms is None or warm_ms is None else round(first_ms - warm_ms, 3)
    error = next((r.error for r in (first, warm) if not served(r)), None)
    return ColdLoad(adapter=adapter, first_ms=first_ms, warm_ms=warm_ms, load_ms=load, error=error)


def load_percentiles(loads: Sequence[ColdLoad]) -> tuple[float | None, float | None]:
    """(p50, p95) of the adapters' load times; (None, None) when none loaded."""
    values = [c.load_ms for c in loads if c.load_ms is not None]
    if not values:
        return None, None
    p50, p95 = (round(float(v), 3) for v in np.percentile(values, (50, 95)))
    return p50, p95


def with_ratios(mixes: dict[str, tuple[list[str], LevelSummary]]) -> list[MixThroughput]:
    """Each mix's throughput against the base alone's (the `base` mix of the same run)."""
    base = mixes.get(BASE)
    base_tps = base[1].output_throughput if base else 0.0
    return [
        MixThroughput(
            mix=label,
            models=models,
            summary=summary,
            vs_base=round(summary.output_throughput / base_tps, 3) if base_tps else None,
        )
        for label, (models, summary) in mixes.items()
    ]


def failed_requests(cold: Sequence[ColdLoad], mixes: Sequence[MixThroughput]) -> int:
    return sum(c.error is not None for c in cold) + sum(m.summary.requests - m.summary.ok for m in mixes)


# --- measuring ----------------------------------------------------------------------------------


async def measure_cold_loads(client: openai.AsyncOpenAI, spec: LoadSpec, adapters: Sequence[str]) -> list[ColdLoad]:
    """Each adapter's first request, then its next, one adapter after another."""
    loads = []
    for name in adapter_names(spec.model, adapters):
        named = spec.model_copy(update={"model": name})
        first = await one_request(client, named, COLD_PROMPT, 1)
        warm = await one_request(client, named, COLD_PROMPT, 1)
        loads.append(cold_load(name, first, warm))
    return loads


async def measure_mix(
    client: openai.AsyncOpenAI,
    spec: LoadSpec,
    models: Sequence[str],
    *,
    concurrency: int,
    requests: int,
    on_result: Callable[[RequestResult], None] | None = None,
) -> LevelSummary:
    """`requests` requests, the i-th to `models[i % len]`, `concurrency` in flight (closed loop);
    prompts and lengths from `spec`'s seed, so every mix sends the same ones."""
    plan = request_plan(spec, np.random.default_rng([spec.seed, concurrency]))
    specs = [spec.model_copy(update={"model": m}) for m in models]
    results: list[RequestResult] = []
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < requests:
            index = sent
            sent += 1  # before the await: workers share one event loop
            prompt, max_tokens = next(plan)
            result = await one_request(client, specs[index % len(specs)], prompt, max_tokens, time.monotonic)
            results.append(result)
            if on_result is not None:
                on_result(result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarise(results, "concurrency", concurrency)


async def measure_adapters(
    spec: LoadSpec,
    adapters: Sequence[str],
    *,
    concurrency: int,
    requests: int,
    on_phase: Callable[[str], None] = lambda _: None,
    on_result: Callable[[RequestResult], None] | None = None,
) -> tuple[list[ColdLoad], list[MixThroughput]]:
    """Cold loads, then the mixes. `spec.model` is the base model, already warm (`llmctl bench`'s
    warm-up request, or the caller's)."""
    async with make_client(spec) as client:
        on_phase(f"cold loads of {len(adapters)} adapters")
        cold = await measure_cold_loads(client, spec, adapters)
        mixes = {}
        for label, models in adapter_mixes(spec.model, adapters).items():
            on_phase(f"mix {label}: {requests} requests, {concurrency} in flight")
            summary = await measure_mix(
                client, spec, models, concurrency=concurrency, requests=requests, on_result=on_result
            )
            mixes[label] = (models, summary)
    return cold, with_ratios(mixes)


async def bench_adapters(
    spec: LoadSpec,
    adapters: Sequence[str],
    *,
    concurrency: int,
    requests: int,
    command: str,
    on_phase: Callable[[str], None] = lambda _: None,
) -> AdapterBenchReport:
    """`measure_adapters`, summarised as the report `llmctl bench --adapters` writes."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    cold, mixes = await measure_adapters(spec, adapters, concurrency=concurrency, requests=requests, on_phase=on_phase)
    p50, p95 = load_percentiles(cold)
    return AdapterBenchReport(
        command=command,
        started_at=started_at,
        base_url=spec.base_url,
        model=spec.model,
        adapters=list(adapters),
        concurrency=concurrency,
        requests_per_mix=requests,
        prompt_tokens=str(spec.prompt_tokens),
        output_tokens=str(spec.output_tokens),
        seed=spec.seed,
        cold_loads=cold,
        cold_load_p50_ms=p50,
        cold_load_p95_ms=p95,
        mixes=mixes,
        failed=failed_requests(cold, mixes),
    )


# --- view ---------------------------------------------------------------------------------------


def adapter_tables(report: AdapterBenchReport) -> list[Table]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    cold = Table(
        "adapter",
        "first request ms",
        "next ms",
        "load ms",
        "error",
        title=f"LoRA cold loads on {report.model} at {report.base_url}",
        title_justify="left",
        caption=f"load over {len(report.adapters)} adapters: p50 {ms(report.cold_load_p50_ms)} ms, "
        f"p95 {ms(report.cold_load_p95_ms)} ms",
    )
    for c in report.cold_loads:
        cold.add_row(c.adapter, ms(c.first_ms), ms(c.warm_ms), ms(c.load_ms), c.error or "")
    mixes = Table(title=f"warm throughput per mix, concurrency {report.concurrency}", title_justify="left")
    for column in ("mix", "models", "ok", "failed", "out tok/s", "vs base", "TTFT p50", "E2E p50", "E2E p99"):
        mixes.add_column(column, justify="left" if column == "mix" else "right")
    mixes.add_column("errors")
    for m in report.mixes:
        s = m.summary
        mixes.add_row(
            m.mix,
            str(len(m.models)),
            str(s.ok),
            str(s.requests - s.ok),
            f"{s.output_throughput:,.1f}",
            "-" if m.vs_base is None else f"{m.vs_base:.3f}",
            ms(s.ttft_ms.p50),
            ms(s.e2e_ms.p50),
            ms(s.e2e_ms.p99),
            ", ".join(f"{k}: {v}" for k, v in s.errors.items()),
        )
    return [cold, mixes]
