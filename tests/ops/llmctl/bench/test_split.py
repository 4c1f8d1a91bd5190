"""A level cut into parts for several client processes, and their results put back together:
the parts add up to the level, the open loop's arrivals stay the one Poisson schedule, and the
merged level is measured over its whole wall time."""

from __future__ import annotations

import numpy as np
import pytest

from ops.llmctl.bench.loadgen import LoadSpec, schedule
from ops.llmctl.bench.split import default_processes, even_split, merge_results, split_level
from ops.llmctl.bench.stats import LengthDistribution, RequestResult, summarise


def spec(**update) -> LoadSpec:
    return LoadSpec(
        base_url="http://127.0.0.1:1/v1",
        model="m",
        prompt_tokens=LengthDistribution.parse("uniform:4-12"),
        output_tokens=LengthDistribution.parse("fixed:8"),
        **update,
    )


def test_even_split_deals_the_remainder_to_the_first_parts():
    assert even_split(16, 3) == [6, 5, 5]
    assert even_split(32, 2) == [16, 16]
    assert even_split(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError):
        even_split(4, 0)


def test_closed_loop_parts_add_up_to_the_level():
    parts = split_level(spec(requests=64), "concurrency", 16, 3)
    assert [p.concurrency for p in parts] == [6, 5, 5]
    assert [p.requests for p in parts] == [22, 21, 21]  # the larger share of requests with the larger share of streams
    assert [p.index for p in parts] == [0, 1, 2]  # each part its own prompt stream
    assert all(p.arrivals is None for p in parts)


def test_closed_loop_never_has_an_empty_part():
    parts = split_level(spec(requests=2), "concurrency", 4, 4)  # more streams than requests
    assert [(p.concurrency, p.requests) for p in parts] == [(1, 1), (1, 1)]
    parts = split_level(spec(requests=8), "concurrency", 2, 4)  # more processes than streams
    assert [(p.concurrency, p.requests) for p in parts] == [(1, 4), (1, 4)]
    parts = split_level(spec(duration_s=5), "concurrency", 3, 2)
    assert [(p.concurrency, p.requests) for p in parts] == [(2, None), (1, None)]


@pytest.mark.parametrize("processes", [1, 2, 3, 7])
def test_open_loop_parts_together_are_the_one_schedule(processes):
    """However many processes send it, the server sees the arrivals one process would send."""
    load = spec(requests=200)
    parts = split_level(load, "rate", 20, processes)
    whole = list(schedule(load, 20))
    assert len(parts) == processes
    merged = sorted((a for p in parts for a in p.arrivals or []), key=lambda a: a.at_s)
    assert merged == whole
    for part in parts:
        times = [a.at_s for a in part.arrivals or []]
        assert times == sorted(times)
    assert max(len(p.arrivals or []) for p in parts) - min(len(p.arrivals or []) for p in parts) <= 1


def test_open_loop_schedule_is_poisson_at_the_rate_and_ends_at_the_duration():
    arrivals = list(schedule(spec(duration_s=1000), 5))
    gaps = np.diff([a.at_s for a in arrivals])
    assert arrivals[0].at_s == 0 and arrivals[-1].at_s < 1000
    assert len(arrivals) == pytest.approx(5 * 1000, rel=0.05)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1, rel=0.05)  # exponential gaps: std = mean
    assert all(4 <= len(a.prompt.split()) <= 12 and a.max_tokens == 8 for a in arrivals[:100])


def test_open_loop_split_needs_an_end():
    with pytest.raises(ValueError, match="request count or a duration"):
        split_level(spec(), "rate", 5, 2)


def result(start: float, end: float, tokens: int = 4) -> RequestResult:
    return RequestResult(
        start=start,
        end=end,
        first_token=start + 0.1,
        chunk_times=[start + 0.1, end],
        prompt_tokens=10,
        output_tokens=tokens,
        requested_output_tokens=tokens,
    )


def test_merged_parts_are_one_level_over_its_whole_wall_time():
    first = [result(0.0, 1.0), result(1.0, 2.0)]
    second = [result(0.5, 1.5), result(1.5, 4.0), result(2.0, 3.0)]
    merged = merge_results([first, second])
    assert [r.start for r in merged] == [0.0, 0.5, 1.0, 1.5, 2.0]
    summary = summarise(merged, "concurrency", 4)
    # 5 requests from the first send (0.0) to the last finish (4.0): not the parts' rates added up
    assert summary.requests == summary.ok == 5 and summary.duration_s == 4.0
    assert summary.request_throughput == 1.25 and summary.output_throughput == 5.0
    assert summary.ttft_ms.p50 == pytest.approx(100)


@pytest.mark.parametrize(
    ("mode", "levels", "cpus", "expected"),
    [
        ("concurrency", [1], 8, 1),
        ("concurrency", [1, 4, 16], 8, 2),
        ("concurrency", [32], 8, 4),
        ("concurrency", [32], 2, 2),
        ("rate", [2, 5], 8, 1),
        ("rate", [20], 8, 3),
    ],
)
def test_default_processes_follow_the_highest_level_up_to_the_cores(mode, levels, cpus, expected):
    assert default_processes(mode, levels, cpus) == expected
