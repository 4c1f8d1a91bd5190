"""The gateway's resume figures, read from its /metrics text (what `stream_resume` and the
autoscaling demo report before and after their kill)."""

from __future__ import annotations

from ops.benchmarks.resume_metrics import counter_deltas, parse_resume_counters, quantile

METRICS = """
# HELP llmstack_gateway_stream_resumes_total Streams continued on another replica.
# TYPE llmstack_gateway_stream_resumes_total counter
llmstack_gateway_stream_resumes_total{model="tiny-chat",reason="reset"} 3.0
llmstack_gateway_stream_resumes_total{model="tiny-chat",reason="eof"} 1.0
# HELP llmstack_gateway_stream_resume_failures_total Resumes that failed.
# TYPE llmstack_gateway_stream_resume_failures_total counter
llmstack_gateway_stream_resume_failures_total{model="tiny-chat",reason="limit"} 1.0
# HELP llmstack_gateway_stream_resume_gap_seconds Gap the client saw.
# TYPE llmstack_gateway_stream_resume_gap_seconds histogram
llmstack_gateway_stream_resume_gap_seconds_bucket{model="tiny-chat",le="1.0"} 2.0
llmstack_gateway_stream_resume_gap_seconds_bucket{model="tiny-chat",le="+Inf"} 4.0
llmstack_gateway_stream_resume_gap_seconds_count{model="tiny-chat"} 4.0
llmstack_gateway_stream_resume_gap_seconds_sum{model="tiny-chat"} 6.0
"""


def test_counters_are_summed_over_labels_and_kept_per_reason():
    counters = parse_resume_counters(METRICS)
    assert counters["llmstack_gateway_stream_resumes_total"] == 4.0
    assert counters["llmstack_gateway_stream_resumes_total{reason=reset}"] == 3.0
    assert counters["llmstack_gateway_stream_resume_failures_total"] == 1.0
    assert counters["llmstack_gateway_stream_resume_gap_seconds_count"] == 4.0


def test_deltas_over_a_run_and_the_mean_gap():
    before = parse_resume_counters(METRICS)
    after = {**before, "llmstack_gateway_stream_resumes_total": 6.0}
    after["llmstack_gateway_stream_resume_gap_seconds_count"] = 6.0
    after["llmstack_gateway_stream_resume_gap_seconds_sum"] = 9.0
    delta = counter_deltas(before, after)
    assert delta["llmstack_gateway_stream_resumes_total"] == 2.0
    assert delta["llmstack_gateway_stream_resume_failures_total"] == 0.0
    assert delta["mean_gap_s"] == 1.5
    assert "mean_gap_s" not in counter_deltas(before, before)  # no resume, no gap


def test_nearest_rank_quantile():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0


def with_gaps(buckets: dict[str, float]) -> dict[str, float]:
    """A run's deltas holding only the gap histogram's buckets (cumulative, as exported) and count."""
    delta = {f"llmstack_gateway_stream_resume_gap_seconds_bucket{{le={le}}}": n for le, n in buckets.items()}
    return delta | {"llmstack_gateway_stream_resume_gap_seconds_count": buckets["+Inf"]}


def test_gap_quantiles_interpolate_within_the_bucket_as_histogram_quantile_does():
    # 4 resumes: one in (0.1, 0.25], three in (0.25, 0.5]. p50 = rank 2: a third into (0.25, 0.5].
    delta = counter_deltas({}, with_gaps({"0.1": 0, "0.25": 1, "0.5": 4, "1.0": 4, "+Inf": 4}))
    assert abs(delta["p50_gap_s"] - (0.25 + 0.25 / 3)) < 1e-9
    assert 0.25 < delta["p99_gap_s"] <= 0.5
    # Every gap past the last finite bound: the bound, not infinity.
    assert counter_deltas({}, with_gaps({"1.0": 0, "+Inf": 2}))["p99_gap_s"] == 1.0


def test_gap_quantiles_are_taken_over_the_run_only():
    before = parse_resume_counters(METRICS)  # before the run: 2 gaps within 1 s, 2 longer
    after = before | {
        "llmstack_gateway_stream_resume_gap_seconds_bucket{le=0.25}": 3.0,
        "llmstack_gateway_stream_resume_gap_seconds_bucket{le=1.0}": 5.0,
        "llmstack_gateway_stream_resume_gap_seconds_bucket{le=+Inf}": 7.0,
        "llmstack_gateway_stream_resume_gap_seconds_count": 7.0,
    }
    delta = counter_deltas(before, after)  # the run: 3 resumes, all within 0.25 s
    assert 0 < delta["p99_gap_s"] <= 0.25  # over the whole history it would be 1.0
