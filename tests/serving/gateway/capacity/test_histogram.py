"""Latency histograms: a percentile read from bucket counts errs slow by at most one bucket
(10 %), never fast, and counts merged by addition read as the samples pooled."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.capacity.histogram import EDGE_MS, GROWTH, Histogram, bucket_of, quantile_ms
from tests.support.hypothesis import examples

ms = st.floats(min_value=0.001, max_value=EDGE_MS[-1], allow_nan=False)


@settings(max_examples=examples(fast=300, deep=3000))
@given(ms)
def test_a_sample_counts_in_the_bucket_whose_range_holds_it(value):
    index = bucket_of(value)
    assert value <= EDGE_MS[index]
    assert index == 0 or value > EDGE_MS[index - 1]


@settings(max_examples=examples(fast=200, deep=2000))
@given(st.lists(ms, min_size=1, max_size=200), st.lists(ms, max_size=200), st.floats(min_value=1, max_value=99.9))
def test_the_percentile_of_merged_counts_is_the_pooled_samples_within_one_bucket(first, second, percentile):
    a, b = Histogram(), Histogram()
    a.extend(first)
    b.extend(second)
    merged = dict(a.counts)
    for bucket, count in b.counts.items():
        merged[bucket] = merged.get(bucket, 0) + count
    pooled = sorted(first + second)
    exact = pooled[max(1, math.ceil(len(pooled) * percentile / 100)) - 1]  # nearest rank
    read = quantile_ms(merged, percentile)
    assert exact <= read <= max(EDGE_MS[0], exact * GROWTH * (1 + 1e-9))


def test_slower_than_the_last_edge_counts_in_the_last_bucket_and_nothing_reads_as_a_percentile():
    assert bucket_of(1e9) == len(EDGE_MS) - 1
    assert quantile_ms({}, 90) is None
    histogram = Histogram()
    histogram.add(5.0)
    assert histogram.total == 1 and histogram.take() == {bucket_of(5.0): 1} and histogram.total == 0
