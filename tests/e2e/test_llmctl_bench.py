"""End to end: `llmctl bench` as a subprocess against the session's shared dev stack (`python -m
ops.devstack`: redis-server, Ray Serve, CPU vLLM, gateway; tests/e2e/conftest.py), through the
gateway with a key and against Ray Serve directly. Small loads, a few seconds each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.spec.stack_file import PROJECT_ROOT

ROOT = PROJECT_ROOT
pytestmark = pytest.mark.slow


@pytest.fixture
def dev_ready(dev_stack) -> dict:
    """The shared stack's ready line: URLs, the dev key, its models."""
    return dev_stack.ready


def llmctl_bench(*args: str, api_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    return subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gateway_levels_json_and_plot(dev_ready, tmp_path):
    out = tmp_path / "gw.json"
    run = llmctl_bench(
        "--url",
        dev_ready["base_url"],
        "--model",
        "tiny-chat",
        "-c",
        "1,4",
        "-n",
        "8",
        "--prompt-tokens",
        "uniform:8-32",
        "--output-tokens",
        "fixed:16",
        "--out",
        str(out),
        api_key=dev_ready["api_key"],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "concurrency" and [s["level"] for s in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert (level["requests"], level["ok"], level["errors"]) == (8, 8, {})
        assert level["output_tokens"] == 8 * 16  # ignore_eos: exactly max_tokens, the server's own count
        assert level["prompt_tokens"] >= 8 * 8
        assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"] <= level["e2e_ms"]["p99"]
        assert level["output_throughput"] > 0 and level["request_throughput"] > 0
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "RateLimitError" not in run.stdout


def test_rate_limited_key_counts_429s_by_type(dev_ready, tmp_path):
    """A key allowed 2 requests a minute: the run completes and reports the gateway's 429s."""
    from serving.gateway.auth.keys import create_key_sync

    key = create_key_sync(dev_ready["redis_url"], tenant="bench-test", name="tight", limits={"requests_per_minute": 2})
    out = tmp_path / "limited.json"
    run = llmctl_bench(
        "--url",
        dev_ready["base_url"],
        "-m",
        "tiny-chat",
        "-c",
        "2",
        "-n",
        "8",
        "--output-tokens",
        "fixed:4",
        "--no-warm-up",
        "--no-plot",
        "--out",
        str(out),
        api_key=key,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    level = json.loads(out.read_text())["levels"][0]
    assert level["requests"] == 8 and 1 <= level["ok"] <= 3
    assert level["errors"] == {"RateLimitError (429)": 8 - level["ok"]}
    assert "requests per minute" in level["error_examples"]["RateLimitError (429)"].lower()
    assert not out.with_suffix(".png").exists()


def test_open_loop_rate_against_ray_serve_completions(dev_ready, tmp_path):
    out = tmp_path / "serve.json"
    model_url = dev_ready["model_urls"][dev_ready["models"][0]]  # Serve serves each model under its own prefix
    run = llmctl_bench(
        "--url",
        model_url,
        "--rate",
        "4",
        "-n",
        "6",
        "--api",
        "completions",
        "--output-tokens",
        "normal:12,3",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model"] == dev_ready["models"][0]  # picked from GET /v1/models
    assert report["base_url"] == model_url
    level = report["levels"][0]
    assert (level["mode"], level["requests"], level["ok"]) == ("rate", 6, 6)


def test_adapters_cold_loads_and_mixes_on_the_real_engine(dev_ready, tmp_path):
    """`--adapters` against tiny-chat's own Serve application: both adapters answer their first and
    next request, and every request of the three mixes is served with exactly its tokens."""
    out = tmp_path / "adapters.json"
    run = llmctl_bench(
        "--url", dev_ready["model_urls"]["tiny-chat"], "-m", "tiny-chat", "--adapters", "sql,pirate",
        "-c", "2", "-n", "6", "--output-tokens", "fixed:4", "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == 0, (report["cold_loads"], [m["summary"]["errors"] for m in report["mixes"]])
    assert [c["adapter"] for c in report["cold_loads"]] == ["tiny-chat:sql", "tiny-chat:pirate"]
    assert all(c["first_ms"] > 0 and c["warm_ms"] > 0 for c in report["cold_loads"])
    assert [m["mix"] for m in report["mixes"]] == ["base", "adapters", "base+adapters"]
    for mix in report["mixes"]:
        assert (mix["summary"]["ok"], mix["summary"]["output_tokens"]) == (6, 6 * 4)
        assert mix["vs_base"] > 0
    assert "LoRA cold loads on tiny-chat" in run.stdout
