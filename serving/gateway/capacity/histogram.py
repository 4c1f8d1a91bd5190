"""Latency samples as counts in fixed log-spaced buckets: cheap to record per chunk, and merged
across gateway replicas by adding counts (a Redis HINCRBY per bucket), which raw percentiles
cannot be.

Bucket `i` holds samples in (EDGE_MS[i-1], EDGE_MS[i]]; each edge is GROWTH times the last, so
a percentile read from the counts is the upper edge of its bucket: never below the true value,
and at most GROWTH - 1 (10 %) above it. An SLO check may err on the slow side, never the fast one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

FIRST_EDGE_MS = 1.0
GROWTH = 1.1
BUCKETS = 100  # the last edge is about 12.5 s; slower samples count in the last bucket
EDGE_MS = tuple(FIRST_EDGE_MS * GROWTH**i for i in range(BUCKETS))


def bucket_of(ms: float) -> int:
    """The bucket a sample of `ms` milliseconds counts in."""
    if ms <= FIRST_EDGE_MS:
        return 0
    # The float log may land a hair either side of an edge: step to the bucket whose range holds it.
    index = min(BUCKETS - 1, math.ceil(math.log(ms / FIRST_EDGE_MS) / math.log(GROWTH)))
    while index > 0 and ms <= EDGE_MS[index - 1]:
        index -= 1
    while index < BUCKETS - 1 and ms > EDGE_MS[index]:
        index += 1
    return index


def quantile_ms(counts: Mapping[int, int], percentile: float) -> float | None:
    """The `percentile` (0-100) of the samples counted in `counts` (bucket -> count), as its
    bucket's upper edge; None without samples. Nearest rank: the smallest value with at least
    `percentile` % of the samples at or below it."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(total * percentile / 100))
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return EDGE_MS[index]
    return EDGE_MS[max(counts)]


@dataclass
class Histogram:
    """Counts of one latency (TTFT or ITL) of one model, since the last flush."""

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, ms: float) -> None:
        index = bucket_of(ms)
        self.counts[index] = self.counts.get(index, 0) + 1

    def extend(self, samples: Iterable[float]) -> None:
        for ms in samples:
            self.add(ms)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def take(self) -> dict[int, int]:
        """The counts so far, and start again from none (what a flush sends)."""
        counts, self.counts = self.counts, {}
        return counts
