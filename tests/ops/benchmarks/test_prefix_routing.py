"""The pure parts of `ops.benchmarks.prefix_routing`: the load it sends and how rounds add up."""

from __future__ import annotations

from infra.spec.stack_file import load_stack
from ops.benchmarks.prefix_routing import LOAD, MODELS, STACK, bench_args, markdown_report, summary


def test_the_stack_routes_one_model_each_way_on_two_replicas():
    spec = load_stack(STACK)
    assert [(m.id, m.routing.value, m.autoscaling.min_replicas) for m in spec.models] == [
        ("tiny-pow2", "pow2", 2),
        ("tiny-prefix", "prefix", 2),
    ]
    assert [m.id for m in spec.models] == list(MODELS)


def test_bench_args_parse_with_the_real_cli(tmp_path):
    from typer.testing import CliRunner

    from ops.harness.processes import free_port
    from ops.llmctl.main import app

    args = bench_args(f"http://127.0.0.1:{free_port()}/v1", "tiny-pow2", 4, 1, tmp_path / "r.json")
    result = CliRunner().invoke(app, ["bench", *args, "--no-warm-up"])
    assert result.exit_code == 1, result.output  # nothing listens there: every turn a connection error
    assert "--workload" in LOAD and "multiturn" in LOAD


def test_summary_weights_hit_rate_by_tokens_and_averages_ttft():
    runs = [
        {
            "round": 1,
            "model": "tiny-pow2",
            "ok": 4,
            "requests": 4,
            "prompt_tokens": 100,
            "cached_prompt_tokens": 50,
            "hit_rate": 0.5,
            "ttft_p50_ms": 10.0,
            "ttft_p90_ms": 20.0,
            "output_throughput": 1,
        },
        {
            "round": 2,
            "model": "tiny-pow2",
            "ok": 4,
            "requests": 4,
            "prompt_tokens": 300,
            "cached_prompt_tokens": 0,
            "hit_rate": 0.0,
            "ttft_p50_ms": 30.0,
            "ttft_p90_ms": 40.0,
            "output_throughput": 1,
        },
        {"round": 1, "model": "tiny-prefix"},
    ]  # a failed run: recorded, left out of the sums
    assert summary(runs) == {
        "tiny-pow2": {"hit_rate": 0.125, "ttft_p50_ms": 20.0, "rounds": 2},
        "tiny-prefix": {"hit_rate": None, "ttft_p50_ms": None, "rounds": 0},
    }
    assert "| 1 | tiny-pow2 | 4/4 | 100 | 50 | 50.0% | 10.0 | 20.0 | 1 |" in markdown_report(runs)
