"""The pure parts of `ops.benchmarks.serving`: engine settings -> vLLM flags, the vLLM benchmark
result parser (on a result file saved from a real `vllm bench serve` run against bare CPU
vLLM on the tiny model: 64 prompts, concurrency 32), ratios and the report table."""

from __future__ import annotations

import json

import pytest

from infra.render.serve_config import llm_config
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.serving import bench_client_args, engine_cli_flags, markdown_report, parse_result, ratios

SAVED_RESULT = PROJECT_ROOT / "tests" / "data" / "vllm_bench_result.json"


def test_engine_kwargs_become_vllm_flags():
    flags = engine_cli_flags(
        {
            "max_model_len": 512,
            "dtype": "float32",
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "quantization": None,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        }
    )
    assert flags == [
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":3}',
    ]


def test_local_replica_settings_as_flags():
    spec = load_stack("local")
    flags = engine_cli_flags(llm_config(spec.model("tiny-chat"), spec)["engine_kwargs"])
    assert flags == [
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        # no media host allowed: vLLM reads an empty list as "any", so a host that never resolves
        "--allowed-media-domains",
        '["data-urls-only.invalid"]',
        # tiny-chat serves LoRA adapters (tiny-chat:sql, tiny-chat:pirate): the slots vLLM reserves
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
    ]


def test_flags_parse_with_vllms_own_parsers():
    """vLLM renames flags between releases; its parsers are the judge (no engine is started)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = load_stack("local")
    engine = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(engine)
    engine_kwargs = llm_config(spec.model("tiny-chat-ngram"), spec)["engine_kwargs"]
    # Frontend flags (the OpenAI server's, e.g. enable_prompt_tokens_details) go to the server's parser.
    frontend = {"enable_prompt_tokens_details"}
    parsed = engine.parse_args(engine_cli_flags({k: v for k, v in engine_kwargs.items() if k not in frontend}))
    assert parsed.enforce_eager is True and parsed.max_model_len == 512 and parsed.enable_prefix_caching is True
    assert parsed.speculative_config["method"] == "ngram"

    client = FlexibleArgumentParser()
    add_cli_args(client)
    args = client.parse_args(bench_client_args("http://127.0.0.1:1", "/models/tiny", 32, 64, "/tmp/x", "r.json"))
    assert (args.max_concurrency, args.num_prompts, args.random_input_len, args.ignore_eos) == (32, 64, 64, True)
    assert args.base_url == "http://127.0.0.1:1" and args.endpoint == "/v1/completions"


def test_parse_saved_vllm_result():
    figures = parse_result(json.loads(SAVED_RESULT.read_text()))
    assert figures["completed"] == 64 and figures["failed"] == 0
    assert figures["max_concurrency"] == 32 and figures["total_output_tokens"] == 64 * 64
    assert figures["output_throughput"] == pytest.approx(3717.03, abs=0.01)
    assert figures["p50_ttft_ms"] == figures["median_ttft_ms"] == pytest.approx(165.876, abs=0.001)
    assert figures["p99_ttft_ms"] == pytest.approx(257.456, abs=0.001)
    assert figures["mean_ttft_ms"] == pytest.approx(189.816, abs=0.001)
    assert "latencies" not in figures  # per-request arrays stay in the raw document only


def _run(target: str, concurrency: int, tok_s: float | None, serving_cpu: float | None = None) -> dict:
    run = {
        "target": target,
        "concurrency": concurrency,
        "num_prompts": 64,
        "completed": 64,
        "failed": 0,
        "output_throughput": tok_s,
        "p50_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
    }
    if serving_cpu is not None:
        run["cpu_ms_per_output_token"] = {"engine": 0.4, "serving layers": serving_cpu}
    return run


def test_ratios_of_a_serving_path_against_bare_vllm():
    results = [
        _run("vllm", 1, 250),
        _run("vllm", 32, 2500),
        _run("serve:direct", 32, 2400),
        _run("gateway:direct", 1, 200),
        _run("gateway:direct", 32, 2000),
        _run("serve:haproxy", 32, 1000),
    ]
    assert ratios(results, "direct") == {
        "gateway_vs_vllm_c32": 0.8,
        "serve_vs_vllm_c32": 0.96,
        "gateway_vs_serve_c32": 0.833,
        "gateway_c32_vs_c1": 10.0,
        "vllm_c32_vs_c1": 10.0,
    }
    assert ratios(results, "haproxy")["serve_vs_vllm_c32"] == 0.4


def test_ratios_are_none_when_a_run_failed():
    failed = {"target": "gateway:direct", "concurrency": 32, "num_prompts": 64, "completed": 0, "failed": 64}
    values = ratios([_run("vllm", 32, 2500), failed], "direct")
    assert values["gateway_vs_vllm_c32"] is None and values["gateway_c32_vs_c1"] is None


def test_report_marks_missed_targets_and_splits_cpu_by_layer():
    results = [
        _run("vllm", 32, 2500),
        _run("serve:direct", 32, 2300, serving_cpu=0.2),
        _run("gateway:direct", 1, 200),
        _run("gateway:direct", 32, 1900),
    ]
    report = markdown_report(results, {"direct": ratios(results, "direct")})
    assert "| full path (gateway), direct | 32 | 1,900 | 10.0 | 20.0 | 64/0 |" in report
    assert "- gateway_vs_vllm_c32: 0.760  (target >= 0.8) MISSED" in report
    assert "- serve_vs_vllm_c32: 0.920  (target >= 0.85) met" in report
    assert "- gateway_c32_vs_c1: 9.500  (target >= 6) met" in report
    assert "| serving layers | 0.200 |" in report
    assert "serving layers CPU-ms per output token (Serve alone, c=32): 0.200  (target <= 0.25) met" in report
    assert "Waiting to run" not in report  # no run-queue figures were read


def test_report_shows_how_long_each_layer_waited_to_run():
    serve = _run("serve:direct", 32, 2300, serving_cpu=0.2) | {
        "run_queue_wait_cores": {"engine": 0.61, "engine worker": 0.27, "client": 0.8}
    }
    report = markdown_report([_run("vllm", 32, 2500), serve], {})
    assert "| engine | 0.610 |" in report and "| engine worker | 0.270 |" in report
    assert "| client | 0.800 |" in report and "| gateway | n/a |" in report


def test_llmctl_client_figures_match_the_vllm_names():
    from ops.benchmarks.serving import figures_from_llmctl
    from ops.llmctl.bench.stats import RequestResult, summarise

    results = [
        RequestResult(
            start=0,
            end=1.0,
            first_token=0.2,
            chunk_times=[0.2, 0.6, 1.0],
            prompt_tokens=64,
            output_tokens=64,
            requested_output_tokens=64,
        )
        for _ in range(4)
    ]
    results.append(RequestResult(start=0, end=0.5, error="APIConnectionError"))
    report = {"levels": [summarise(results, "concurrency", 32).model_dump()]}
    figures = figures_from_llmctl(report)
    assert set(parse_result({})) <= set(figures)  # every figure the report table and ratios read
    assert (figures["completed"], figures["failed"], figures["max_concurrency"]) == (4, 1, 32)
    assert figures["output_throughput"] == 256.0 and figures["total_output_tokens"] == 256
    assert figures["p50_ttft_ms"] == figures["median_ttft_ms"] == pytest.approx(200)
    assert figures["p99_itl_ms"] == pytest.approx(400)


def test_llmctl_bench_args_parse_with_the_real_cli(tmp_path):
    """The arguments reach `llmctl bench`: typer parses them and, with no server there, every
    request is reported as a connection error (exit 1: nothing succeeded)."""
    from typer.testing import CliRunner

    from ops.benchmarks.serving import llmctl_bench_args
    from ops.harness.processes import free_port
    from ops.llmctl.main import app

    args = llmctl_bench_args(f"http://127.0.0.1:{free_port()}", 32, 64, str(tmp_path / "r.json"))
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 1, result.output
    level = json.loads((tmp_path / "r.json").read_text())["levels"][0]
    assert (level["level"], level["requests"], level["errors"]) == (32, 64, {"APIConnectionError": 64})


def test_a_target_that_refuses_every_request_shows_its_answer(tmp_path, capsys):
    """Every request of a run gets a 400: the log and the report carry the status and the body,
    not only `0 ok` (the real `llmctl bench` client, against a stub that refuses)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ops.benchmarks.serving import bench
    from tests.support.servers import serving

    refusal = {
        "error": {
            "message": "ignore_eos: extra inputs are not permitted " + "x" * 400,
            "type": "BadRequestError",
            "code": "invalid_request_body",
        }
    }

    async def completions(request):
        await request.json()
        return JSONResponse(refusal, status_code=400)

    with serving(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])) as url:
        result = bench("gateway:direct", url, "sk-test", "unused", 1, 3, tmp_path, client_name="llmctl")
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["first_error"].startswith('HTTP 400: {"error":{"message":"ignore_eos: extra inputs')
    assert len(result["first_error"]) == len("HTTP 400: ") + 300  # the body, truncated
    assert result["first_error"] in capsys.readouterr().err
    report = markdown_report([result], {})
    assert f"- full path (gateway), direct, concurrency 1: {result['first_error']}" in report
