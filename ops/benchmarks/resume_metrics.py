"""The gateway's stream-resume figures, read from its /metrics before and after a kill: resumes
and failed resumes (summed over labels, and per reason), and its resume-gap histogram's count
and sum, and its buckets, from which the gap's p50/p99 over the run's resumes are estimated as
Prometheus's `histogram_quantile` does (linear within a bucket: the figure an operator's
dashboard shows). Shared by `ops.benchmarks.stream_resume` and `ops.benchmarks.autoscale_demo`;
the parsing is pure, one function fetches."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

RESUME_METRICS = (
    "llmstack_gateway_stream_resumes",
    "llmstack_gateway_stream_resume_failures",
    "llmstack_gateway_answer_retries",
)
GAP_COUNT = "llmstack_gateway_stream_resume_gap_seconds_count"
GAP_SUM = "llmstack_gateway_stream_resume_gap_seconds_sum"
GAP_BUCKET = "llmstack_gateway_stream_resume_gap_seconds_bucket"


def parse_resume_counters(text: str) -> dict[str, float]:
    """From a /metrics page: each resume counter summed over its labels and per `reason` (which
    ends were resumed, which resumes failed), and the gap histogram's count and sum."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if any(sample.name == f"{name}_total" for name in RESUME_METRICS):
                by_reason = f"{sample.name}{{reason={sample.labels.get('reason', '')}}}"
                out[by_reason] = out.get(by_reason, 0.0) + sample.value
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name in (GAP_COUNT, GAP_SUM):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name == GAP_BUCKET:  # cumulative count per upper bound, summed over models
                by_bound = f"{GAP_BUCKET}{{le={sample.labels['le']}}}"
                out[by_bound] = out.get(by_bound, 0.0) + sample.value
    return out


def resume_counters(metrics_url: str) -> dict[str, float]:
    """`parse_resume_counters` of the gateway's /metrics at `metrics_url`."""
    return parse_resume_counters(httpx.get(f"{metrics_url}/metrics", timeout=10).text)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a run added to each counter, and the mean gap of its resumes when there were some."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after.keys() | before.keys()}
    for name in (f"{metric}_total" for metric in RESUME_METRICS):
        delta.setdefault(name, 0.0)  # a counter no request touched yet is not exported: 0
    if delta.get(GAP_COUNT):
        delta["mean_gap_s"] = delta.get(GAP_SUM, 0.0) / delta[GAP_COUNT]
        for name, q in (("p50_gap_s", 0.5), ("p99_gap_s", 0.99)):
            if (value := gap_quantile(delta, q)) is not None:
                delta[name] = value
    return dict(sorted(delta.items()))


def gap_quantile(delta: dict[str, float], q: float) -> float | None:
    """The q-quantile of the run's resume gaps from its bucket counts (`counter_deltas`' keys),
    as `histogram_quantile`: linear between the bounds of the bucket holding rank q * count; a
    rank in the +Inf bucket gives the highest finite bound. None without a resume."""
    buckets = sorted(
        (float(name[len(GAP_BUCKET) + 4 : -1]), count) for name, count in delta.items() if name.startswith(GAP_BUCKET)
    )
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank: the ceil(q * n)-th smallest) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]
