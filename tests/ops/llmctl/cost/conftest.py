"""A bench report with throughput a reader can check by hand, written as `llmctl bench --out` does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ops.llmctl.bench.stats import BenchReport, RequestResult, summarise


@pytest.fixture
def bench_file(tmp_path) -> Callable[..., Path]:
    def write(model: str, levels: dict[int, tuple[int, int]], name: str = "bench.json") -> Path:
        return _write_bench(tmp_path / name, model, levels)

    return write


def _write_bench(path: Path, model: str, levels: dict[int, tuple[int, int]]) -> Path:
    """A report with one level per concurrency: (prompt, output) tokens per second, from ten
    requests that all run from t=0 to t=1 s."""
    summaries = []
    for level, (prompt_per_s, output_per_s) in levels.items():
        # the first request carries the remainder, so the level's totals are exactly the figures
        results = [
            RequestResult(
                start=0.0,
                end=1.0,
                first_token=0.1,
                chunk_times=[0.1, 1.0],
                prompt_tokens=prompt_per_s // 10 + (prompt_per_s % 10 if i == 0 else 0),
                output_tokens=output_per_s // 10 + (output_per_s % 10 if i == 0 else 0),
                requested_output_tokens=output_per_s // 10,
            )
            for i in range(10)
        ]
        summaries.append(summarise(results, "concurrency", level))
    report = BenchReport(
        command="llmctl bench",
        started_at="2026-11-20T10:00:00+00:00",
        base_url="http://gw/v1",
        model=model,
        api="chat",
        mode="concurrency",
        prompt_tokens="fixed:50",
        output_tokens="fixed:50",
        requests_per_level=10,
        duration_s_per_level=None,
        ignore_eos=True,
        seed=0,
        levels=summaries,
    )
    path.write_text(report.model_dump_json(indent=2))
    return path
