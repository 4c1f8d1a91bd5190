"""`llmctl bench` without a model: the PNG from a report, the one-line failure when nothing
answers at --url, and levels sent from several client processes to the stub upstream."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port
from ops.llmctl.bench.plot import plot_report
from ops.llmctl.bench.stats import BenchReport, RequestResult, summarise

ROOT = PROJECT_ROOT


def _report() -> BenchReport:
    levels = []
    for level in (1, 4, 16):
        results = [
            RequestResult(
                start=i * 0.1,
                end=i * 0.1 + 0.05 * level,
                first_token=i * 0.1 + 0.01 * level,
                chunk_times=[i * 0.1 + 0.01 * level, i * 0.1 + 0.05 * level],
                prompt_tokens=8,
                output_tokens=2,
                requested_output_tokens=2,
            )
            for i in range(8)
        ]
        results.append(RequestResult(start=0, end=0.01, error="RateLimitError (429)", error_message="slow down"))
        levels.append(summarise(results, "concurrency", level))
    return BenchReport(
        command="llmctl bench",
        started_at="2026-01-01T00:00:00+00:00",
        base_url="http://x/v1",
        model="m",
        api="chat",
        mode="concurrency",
        prompt_tokens="fixed:8",
        output_tokens="fixed:2",
        requests_per_level=9,
        duration_s_per_level=None,
        ignore_eos=True,
        seed=0,
        levels=levels,
    )


def test_plot_is_a_png(tmp_path):
    path = plot_report(_report(), tmp_path / "sub" / "plot.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_report_round_trips_through_json():
    report = _report()
    assert BenchReport.model_validate_json(report.model_dump_json()) == report


def test_unreachable_endpoint_is_one_line_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.llmctl.main",
            "bench",
            "--url",
            f"http://127.0.0.1:{free_port()}/v1",
            "-m",
            "x",
            "-n",
            "1",
            "--out",
            str(tmp_path / "x.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "APIConnectionError" in run.stderr and "running" in run.stderr
    assert not (tmp_path / "x.json").exists()


def test_bad_distribution_is_one_line_exit_2(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.llmctl.main",
            "bench",
            "--url",
            "http://127.0.0.1:1/v1",
            "--prompt-tokens",
            "zipf:3",
            "--out",
            str(tmp_path / "x.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--prompt-tokens" in run.stderr and "uniform:32-128" in run.stderr


@pytest.mark.parametrize("mode", [["-c", "1,4"], ["--rate", "20"]])
def test_levels_are_sent_from_the_client_processes_asked_for(tmp_path, mode):
    """`--processes 2` against the stub upstream: every level's requests come back as one level."""
    from ops.harness.stub_upstream import app
    from tests.support.servers import serving

    out = tmp_path / "x.json"
    with serving(app()) as url:
        run = subprocess.run(
            [sys.executable, "-m", "ops.llmctl.main", "bench", "--url", url, "-m", "tiny", *mode]
            + ["-n", "8", "--processes", "2", "--no-plot", "--out", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-2000:]
    report = BenchReport.model_validate_json(out.read_text())
    assert report.client_processes == 2
    assert [(s.requests, s.ok, s.errors) for s in report.levels] == [(8, 8, {})] * len(report.levels)
