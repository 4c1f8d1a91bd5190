"""`llmctl bench`'s numbers: length distributions, one request's outcome, a level's summary.

Pure: no I/O, no clock. The load generator (`ops.llmctl.bench.loadgen`) fills `RequestResult`s with
timestamps it measured; everything reported (throughput, percentiles, errors by type) is
computed here, so tests can check it on hand-made results.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

PERCENTILES = (50, 90, 99)

_DIST = re.compile(
    r"^(?:(?P<fixed>fixed):(?P<n>\d+)|(?P<uniform>uniform):(?P<lo>\d+)-(?P<hi>\d+)"
    r"|(?P<normal>normal):(?P<mean>\d+(?:\.\d+)?),(?P<std>\d+(?:\.\d+)?)|(?P<bare>\d+))$"
)


class LengthDistribution(BaseModel):
    """Token counts drawn per request: `fixed:64` (or `64`), `uniform:32-128`, `normal:64,16`.

    Normal draws are rounded and clipped to at least 1 token, so a wide spread cannot ask
    for zero or negative lengths.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["fixed", "uniform", "normal"] = Field(description="Shape of the distribution.")
    a: float = Field(description="fixed: the value; uniform: low bound; normal: mean.")
    b: float = Field(default=0, description="uniform: high bound (inclusive); normal: standard deviation.")

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        match = _DIST.match(text.strip().replace(" ", ""))
        if not match:
            raise ValueError(
                f"length distribution {text!r} not understood; use fixed:64, uniform:32-128 or normal:64,16"
            )
        if match["fixed"] or match["bare"]:
            value = int(match["n"] or match["bare"])
            if value < 1:
                raise ValueError(f"length distribution {text!r}: lengths must be at least 1 token")
            return cls(kind="fixed", a=value)
        if match["uniform"]:
            lo, hi = int(match["lo"]), int(match["hi"])
            if not 1 <= lo <= hi:
                raise ValueError(f"length distribution {text!r}: need 1 <= low <= high, e.g. uniform:32-128")
            return cls(kind="uniform", a=lo, b=hi)
        mean, std = float(match["mean"]), float(match["std"])
        if mean < 1:
            raise ValueError(f"length distribution {text!r}: the mean must be at least 1 token")
        return cls(kind="normal", a=mean, b=std)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        else:
            values = np.rint(rng.normal(self.a, self.b, size=n))
        return [int(v) for v in np.clip(values, 1, None)]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"uniform:{self.a:g}-{self.b:g}" if self.kind == "uniform" else f"normal:{self.a:g},{self.b:g}"


class RequestResult(BaseModel):
    """One request as the client saw it. Times are seconds on the run's monotonic clock."""

    start: float = Field(description="When the request was sent.")
    end: float = Field(description="When the stream ended or the error arrived.")
    first_token: float | None = Field(default=None, description="When the first content chunk arrived.")
    chunk_times: list[float] = Field(default_factory=list, description="Arrival of every content chunk.")
    prompt_tokens: int = Field(default=0, description="From the usage chunk (the server's own count).")
    cached_tokens: int | None = Field(
        default=None,
        description="Prompt tokens the server had in its prefix cache (usage "
        "prompt_tokens_details.cached_tokens); None when it does not report them.",
    )
    output_tokens: int = Field(default=0, description="From the usage chunk; chunks counted if none came.")
    requested_output_tokens: int = Field(default=0, description="max_tokens sent.")
    error: str | None = Field(default=None, description="Error type, e.g. `RateLimitError (429)`; None if ok.")
    error_message: str | None = Field(default=None, description="The error's first line, for the report.")


class Stats(BaseModel):
    """Milliseconds; None when nothing was measured (no successful request)."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class LevelSummary(BaseModel):
    """Everything reported for one load level (one concurrency or one request rate)."""

    mode: Literal["concurrency", "rate"] = Field(description="Closed loop (concurrency) or open loop (rate).")
    level: float = Field(description="Concurrent requests, or requests per second.")
    requests: int = Field(description="Requests sent.")
    ok: int = Field(description="Requests that streamed to the end.")
    errors: dict[str, int] = Field(description="Failed requests by error type.")
    error_examples: dict[str, str] = Field(default_factory=dict, description="One message per error type.")
    duration_s: float = Field(description="First request sent to last one finished.")
    request_throughput: float = Field(description="Successful requests per second.")
    output_throughput: float = Field(description="Output tokens per second (successful requests).")
    total_token_throughput: float = Field(description="Prompt + output tokens per second.")
    prompt_tokens: int = Field(description="Prompt tokens of successful requests (server's count).")
    output_tokens: int = Field(description="Output tokens of successful requests (server's count).")
    ttft_ms: Stats = Field(description="Time to first token.")
    itl_ms: Stats = Field(description="Gap between content chunks (servers may batch tokens per chunk).")
    tpot_ms: Stats = Field(description="Time per output token after the first: (e2e - ttft) / (tokens - 1).")
    e2e_ms: Stats = Field(description="End-to-end latency of successful requests.")
    cached_prompt_tokens: int | None = Field(
        default=None, description="Prompt tokens served from the prefix cache (None: the server reports none)."
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None, description="cached_prompt_tokens / prompt_tokens of the requests that reported it."
    )
    cpu_ms_per_output_token: dict[str, float] = Field(
        default_factory=dict,
        description="CPU-ms per output token by layer (--cpu-layers; ops.llmctl.bench.cpu_layers).",
    )


def stats_ms(seconds: list[float]) -> Stats:
    """Mean and p50/p90/p99 in milliseconds (numpy's linear interpolation)."""
    if not seconds:
        return Stats()
    values = np.asarray(seconds) * 1000.0
    p50, p90, p99 = (round(float(v), 3) for v in np.percentile(values, PERCENTILES))
    return Stats(mean=round(float(values.mean()), 3), p50=p50, p90=p90, p99=p99)


def error_type(exc: BaseException) -> str:
    """The bucket a failure is counted in: the exception class, plus the HTTP status if any,
    e.g. `RateLimitError (429)`, `APIConnectionError`, `InternalServerError (503)`."""
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__} ({status})" if status else type(exc).__name__


def summarise(results: list[RequestResult], mode: Literal["concurrency", "rate"], level: float) -> LevelSummary:
    """Throughput over the level's wall time (first send to last finish) and latency stats of
    the successful requests; failures are counted by type and kept out of the latencies."""
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    duration = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_second = (lambda x: round(x / duration, 3)) if duration > 0 else (lambda x: 0.0)
    examples: dict[str, str] = {}
    for r in failed:
        assert r.error is not None  # failed: those with an error
        examples.setdefault(r.error, (r.error_message or "")[:300])
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [
        (r.end - r.first_token) / (r.output_tokens - 1) for r in ok if r.first_token is not None and r.output_tokens > 1
    ]
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported) if reported else None
    reported_prompt = sum(r.prompt_tokens for r in reported)
    return LevelSummary(
        mode=mode,
        level=level,
        requests=len(results),
        ok=len(ok),
        errors=dict(Counter(r.error for r in failed)),
        error_examples=examples,
        duration_s=round(duration, 3),
        request_throughput=per_second(len(ok)),
        output_throughput=per_second(output),
        total_token_throughput=per_second(prompt + output),
        prompt_tokens=prompt,
        output_tokens=output,
        ttft_ms=stats_ms(ttft),
        itl_ms=stats_ms(itl),
        tpot_ms=stats_ms(tpot),
        e2e_ms=stats_ms([r.end - r.start for r in ok]),
        cached_prompt_tokens=cached,
        prefix_cache_hit_rate=round(cached / reported_prompt, 4) if cached is not None and reported_prompt else None,
    )


def parse_levels(text: str) -> list[float]:
    """`1,4,16` -> [1, 4, 16]; every level positive."""
    try:
        levels = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"levels {text!r} not understood; give numbers separated by commas, e.g. 1,4,16") from None
    if not levels or any(v <= 0 for v in levels):
        raise ValueError(f"levels {text!r}: give one or more positive numbers, e.g. 1,4,16")
    return levels


class BenchReport(BaseModel):
    """The JSON `llmctl bench --out` writes: the settings, then one summary per level."""

    command: str = Field(description="The command line that produced this report.")
    started_at: str = Field(description="UTC time the run started (ISO 8601).")
    base_url: str = Field(description="Endpoint measured.")
    model: str = Field(description="Model requested.")
    api: str = Field(description="chat or completions.")
    mode: Literal["concurrency", "rate"] = Field(description="How load levels are expressed.")
    workload: str = Field(default="single", description="single requests, or multiturn conversations.")
    prompt_tokens: str = Field(description="Prompt length distribution (words, about one token each).")
    output_tokens: str = Field(description="max_tokens distribution.")
    requests_per_level: int | None = Field(description="Request count per level, if set.")
    duration_s_per_level: float | None = Field(description="Sending time per level, if set.")
    ignore_eos: bool = Field(description="Whether exactly max_tokens were asked for (vLLM extension).")
    seed: int = Field(description="Seed of prompts, lengths and arrivals.")
    client_processes: int = Field(
        default=1, description="Processes the load was sent from, each with its own client (--processes)."
    )
    levels: list[LevelSummary] = Field(description="One summary per load level, in the order run.")


def default_requests(mode: Literal["concurrency", "rate"], level: float) -> int:
    """Requests per level when neither a count nor a duration is given: enough for a p90
    (at least 16), four rounds of a closed loop, ten seconds of an open one."""
    return max(16, int(4 * level) if mode == "concurrency" else int(10 * level))
