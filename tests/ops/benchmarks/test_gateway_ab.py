"""The A/B latency benchmark's pure parts: round order, per-round figures, the summary."""

from __future__ import annotations

import math

import pytest

from ops.benchmarks.gateway_ab import quantile, round_figures, round_order, summarize


def test_round_order_flips_every_other_round_so_no_target_always_goes_first():
    names = ["direct", "candidate", "baseline"]
    assert round_order(0, names) == names
    assert round_order(1, names) == ["baseline", "candidate", "direct"]
    assert round_order(2, names) == names
    assert names == ["direct", "candidate", "baseline"]  # not reversed in place


def test_round_figures_subtract_the_direct_batch_and_divide_candidate_by_baseline():
    figures = round_figures({"direct": 1.0, "candidate": 3.2, "baseline": 3.0})
    assert figures == {"candidate_added_ms": 2.2, "baseline_added_ms": 2.0, "ratio": 1.1}


def test_a_round_where_the_baseline_added_nothing_has_no_ratio():
    assert math.isnan(round_figures({"direct": 2.0, "candidate": 2.5, "baseline": 1.9})["ratio"])


def test_quantile_interpolates_between_ranks():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    assert quantile([7.0], 0.75) == 7.0


def test_summary_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    rounds = [
        {
            "candidate_added_ms": c,
            "baseline_added_ms": b,
            "ratio": round(c / b, 4),
            "candidate_cpu_ms": 2.0,
            "baseline_cpu_ms": 1.0,
        }
        for c, b in [(1.0, 1.0), (4.0, 2.0), (1.2, 1.0), (3.0, 4.0), (5.0, 5.0)]
    ]
    rounds.append(
        {
            "candidate_added_ms": 1.0,
            "baseline_added_ms": -0.1,
            "ratio": float("nan"),
            "candidate_cpu_ms": 2.0,
            "baseline_cpu_ms": 1.0,
        }
    )
    result = summarize(rounds)
    assert result["ratio_median"] == 1.0  # ratios 0.75, 1, 1, 1.2, 2
    assert (result["ratio_min"], result["ratio_q1"], result["ratio_q3"], result["ratio_max"]) == (0.75, 1.0, 1.2, 2.0)
    assert (result["rounds"], result["rounds_with_ratio"]) == (6, 5)
    assert result["candidate_added_ms_median"] == 2.1 and result["baseline_added_ms_median"] == 1.5
    assert result["candidate_cpu_ms_per_request_median"] == 2.0


def test_summary_refuses_rounds_that_say_nothing():
    with pytest.raises(ValueError, match="positive baseline"):
        summarize([{"candidate_added_ms": 1.0, "baseline_added_ms": 0.0, "ratio": float("nan")}])
