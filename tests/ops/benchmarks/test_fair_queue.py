"""The fair queue benchmark's arithmetic: Jain's index, percentiles, the summary of raw records."""

from __future__ import annotations

import pytest

from ops.benchmarks.fair_queue import jain_index, percentile, scenarios, summarize


def test_jain_index_is_one_for_equal_shares_and_one_over_n_for_a_monopoly():
    assert jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([20, 0, 0, 0]) == pytest.approx(0.25)
    assert 0.25 < jain_index([10, 5, 3, 2]) < 1


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([], 99) is None


def test_summary_counts_outcomes_and_serves_within_the_window():
    records = [
        {"tenant": "a", "status": 200, "ttft": 0.1, "wait": 0.0, "done": 5.0},
        {"tenant": "a", "status": 200, "ttft": 0.3, "wait": 0.2, "done": 40.0},
        {"tenant": "a", "status": 429, "done": 6.0},
        {"tenant": "a", "status": 0, "error": "ReadError", "done": 7.0},
    ]
    a = summarize(records, ["a"], (1.0, 30.0))["a"]
    assert (a["sent"], a["ok"], a["status_429"], a["status_5xx"], a["served_in_window"]) == (4, 2, 1, 1, 1)
    assert a["ttft_p99_s"] == 0.3


def test_the_noisy_neighbour_floods_at_twice_the_capacity_the_quiet_one_uses_a_tenth():
    loads = {load["tenant"]: load for load in scenarios(capacity=8, service_s=0.5)["noisy_fair"]["loads"]}
    assert loads["a"]["rate"] == pytest.approx(32.0) and loads["b"]["rate"] == pytest.approx(1.6)
    assert not scenarios(8, 0.5)["noisy_fcfs"]["queue"]
