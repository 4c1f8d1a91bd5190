"""The pure parts of `llmctl bench`: length distributions, levels, error types, summaries."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from ops.llmctl.bench.cli import BenchError, load_levels, normalise_base_url
from ops.llmctl.bench.stats import (
    LengthDistribution,
    RequestResult,
    default_requests,
    error_type,
    parse_levels,
    summarise,
)


@pytest.mark.parametrize(
    "text, kind, a, b",
    [
        ("fixed:64", "fixed", 64, 0),
        ("64", "fixed", 64, 0),
        ("uniform:32-128", "uniform", 32, 128),
        ("normal:64,16", "normal", 64, 16),
        (" normal: 64.5, 8 ", "normal", 64.5, 8),
    ],
)
def test_distribution_forms(text, kind, a, b):
    dist = LengthDistribution.parse(text)
    assert (dist.kind, dist.a, dist.b) == (kind, a, b)
    assert LengthDistribution.parse(str(dist)) == dist  # the report's spelling parses back


@pytest.mark.parametrize("text", ["", "fixed:0", "uniform:128-32", "uniform:0-8", "normal:0,4", "zipf:2", "fixed:-1"])
def test_bad_distributions_say_the_forms(text):
    with pytest.raises(ValueError, match="fixed:64|at least 1|low <= high"):
        LengthDistribution.parse(text)


def test_samples_are_seeded_and_in_range():
    uniform = LengthDistribution.parse("uniform:32-128")
    first = uniform.sample(np.random.default_rng(7), 2000)
    assert first == uniform.sample(np.random.default_rng(7), 2000)
    assert min(first) == 32 and max(first) == 128  # both ends inclusive
    normal = LengthDistribution.parse("normal:64,16").sample(np.random.default_rng(0), 5000)
    assert abs(np.mean(normal) - 64) < 1 and abs(np.std(normal) - 16) < 1
    assert min(LengthDistribution.parse("normal:2,50").sample(np.random.default_rng(0), 1000)) == 1
    assert LengthDistribution.parse("fixed:9").sample(np.random.default_rng(0), 3) == [9, 9, 9]


def _ok(start: float, ttft: float, chunks: int, gap: float, prompt: int = 10) -> RequestResult:
    times = [start + ttft + i * gap for i in range(chunks)]
    return RequestResult(
        start=start,
        end=times[-1],
        first_token=times[0],
        chunk_times=times,
        prompt_tokens=prompt,
        output_tokens=chunks,
        requested_output_tokens=chunks,
    )


def _failed(start: float, end: float, kind: str, message: str = "boom") -> RequestResult:
    return RequestResult(start=start, end=end, error=kind, error_message=message)


def test_summary_throughput_and_percentiles():
    # Four requests over 0..2 s: TTFTs 100, 200, 300, 400 ms; 11 chunks 10 ms apart each.
    results = [_ok(start=0.5 * i, ttft=0.1 * (i + 1), chunks=11, gap=0.01) for i in range(4)]
    results[-1] = results[-1].model_copy(update={"end": 2.0})  # the run ends at 2.0 s
    summary = summarise(results, "concurrency", 4)
    assert (summary.requests, summary.ok, summary.errors) == (4, 4, {})
    assert summary.duration_s == 2.0
    assert summary.request_throughput == 2.0 and summary.output_throughput == 22.0
    assert summary.total_token_throughput == 42.0 and summary.prompt_tokens == 40
    assert summary.ttft_ms.p50 == pytest.approx(250) and summary.ttft_ms.mean == pytest.approx(250)
    assert summary.ttft_ms.p99 == pytest.approx(397, abs=0.01)  # numpy's linear interpolation
    assert summary.itl_ms.p50 == pytest.approx(10) and summary.itl_ms.p99 == pytest.approx(10)
    assert summary.tpot_ms.p50 == pytest.approx(10)
    assert summary.e2e_ms.p50 == pytest.approx(350)


def test_failures_are_counted_by_type_and_kept_out_of_latency():
    results = [
        _ok(0, 0.1, 5, 0.01),
        _failed(0, 0.01, "RateLimitError (429)", "Rate limit reached for requests"),
        _failed(0.1, 0.2, "RateLimitError (429)", "again"),
        _failed(0.2, 1.0, "APIConnectionError"),
    ]
    summary = summarise(results, "rate", 2.5)
    assert summary.ok == 1 and summary.requests == 4
    assert summary.errors == {"RateLimitError (429)": 2, "APIConnectionError": 1}
    assert summary.error_examples["RateLimitError (429)"] == "Rate limit reached for requests"
    assert summary.e2e_ms.p99 == pytest.approx(140) and summary.output_throughput == 5.0  # 5 tokens / 1.0 s


def test_summary_when_nothing_succeeded_has_no_latencies():
    summary = summarise([_failed(0, 1, "APITimeoutError")], "concurrency", 1)
    assert summary.ok == 0 and summary.ttft_ms.p50 is None and summary.output_throughput == 0
    assert summarise([], "concurrency", 1).requests == 0


def test_error_types_name_class_and_status():
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    limited = openai.RateLimitError("slow down", response=httpx.Response(429, request=request), body=None)
    assert error_type(limited) == "RateLimitError (429)"
    unavailable = openai.InternalServerError("busy", response=httpx.Response(503, request=request), body=None)
    assert error_type(unavailable) == "InternalServerError (503)"
    assert error_type(openai.APIConnectionError(request=request)) == "APIConnectionError"
    assert error_type(httpx.RemoteProtocolError("peer closed")) == "RemoteProtocolError"


def test_levels():
    assert parse_levels("1,4,16") == [1, 4, 16]
    assert load_levels(None, None) == ("concurrency", [1, 4, 16])
    assert load_levels(None, "0.5,2") == ("rate", [0.5, 2])
    for bad in ("0", "a,b", ","):
        with pytest.raises(BenchError, match="e.g. 1,4,16"):
            load_levels(bad, None)
    with pytest.raises(BenchError, match="whole numbers"):
        load_levels("1.5", None)
    with pytest.raises(BenchError, match="not both"):
        load_levels("1", "2")
    assert default_requests("concurrency", 1) == 16 and default_requests("concurrency", 16) == 64
    assert default_requests("rate", 5) == 50


def test_base_url():
    assert normalise_base_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert normalise_base_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/v1"
    assert normalise_base_url("https://gw.example.com/v1/") == "https://gw.example.com/v1"
    with pytest.raises(BenchError, match="not an http"):
        normalise_base_url("127.0.0.1:8080")
