"""`llmctl bench --adapters`: the mixes and the summaries (pure), and the measurement through real
HTTP with the official client against a server that knows two of three adapters: each adapter's
first and next request, the mixes' requests cycling over their models, every failure counted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.stub_upstream import chunk, sse
from ops.llmctl.bench.adapters import (
    AdapterBenchReport,
    ColdLoad,
    adapter_mixes,
    cold_load,
    failed_requests,
    load_percentiles,
    measure_adapters,
    parse_adapters,
    with_ratios,
)
from ops.llmctl.bench.loadgen import LoadSpec
from ops.llmctl.bench.stats import LengthDistribution, RequestResult, summarise
from tests.support.servers import serving


def test_mixes_start_with_the_base_alone_and_name_adapters_as_clients_do():
    assert adapter_mixes("tiny-chat", ["sql", "pirate"]) == {
        "base": ["tiny-chat"],
        "adapters": ["tiny-chat:sql", "tiny-chat:pirate"],
        "base+adapters": ["tiny-chat", "tiny-chat:sql", "tiny-chat:pirate"],
    }
    assert parse_adapters(" sql,pirate ") == ["sql", "pirate"]
    for bad in ("sql,,pirate", "", "sql,sql"):
        with pytest.raises(ValueError):
            parse_adapters(bad)


def test_cold_load_is_the_first_request_less_the_next_and_failures_have_none():
    first = RequestResult(start=10.0, end=10.5)
    warm = RequestResult(start=11.0, end=11.1)
    assert cold_load("m:a", first, warm) == ColdLoad(adapter="m:a", first_ms=500.0, warm_ms=100.0, load_ms=400.0)
    # A one-token answer may decode to no text (a byte piece of a character): served all the same.
    silent = RequestResult(start=11.0, end=11.1, output_tokens=1, error="NoOutput")
    assert cold_load("m:a", first, silent).load_ms == 400.0
    assert cold_load("m:a", first, silent.model_copy(update={"output_tokens": 0})).load_ms is None
    refused = RequestResult(start=0, end=0.01, error="NotFoundError (404)")
    failed = cold_load("m:x", refused, refused)
    assert (failed.first_ms, failed.load_ms, failed.error) == (None, None, "NotFoundError (404)")
    loads = [ColdLoad(adapter=f"m:{i}", first_ms=None, warm_ms=None, load_ms=float(i)) for i in range(1, 21)]
    assert load_percentiles([*loads, failed]) == (10.5, 19.05)  # numpy's linear interpolation, failures left out
    assert load_percentiles([failed]) == (None, None)


def test_ratios_are_against_the_base_alone_of_the_same_run():
    def level(tokens: int, errors: int = 0) -> list[RequestResult]:
        ok = [RequestResult(start=0, end=1, output_tokens=tokens, first_token=0.5, chunk_times=[0.5])]
        return ok + [RequestResult(start=0, end=1, error="InternalServerError (503)")] * errors

    mixes = with_ratios(
        {
            "base": (["m"], summarise(level(100), "concurrency", 1)),
            "adapters": (["m:a"], summarise(level(80, errors=2), "concurrency", 1)),
        }
    )
    assert [(m.mix, m.vs_base) for m in mixes] == [("base", 1.0), ("adapters", 0.8)]
    cold = [ColdLoad(adapter="m:a", first_ms=None, warm_ms=None, load_ms=None, error="APIConnectionError")]
    assert failed_requests(cold, mixes) == 3
    assert with_ratios({"adapters": (["m:a"], summarise(level(80), "concurrency", 1))})[0].vs_base is None


class AdapterServer:
    """Streams one word per output token for the base and the adapters it holds; 404 like vLLM for
    an adapter it cannot load. Records the model of every request, in arrival order."""

    def __init__(self, model: str, adapters: set[str]) -> None:
        self.known = {model, *(f"{model}:{a}" for a in adapters)}
        self.models: list[str] = []

    async def chat(self, request: Request):
        body = await request.json()
        self.models.append(body["model"])
        if body["model"] not in self.known:
            error = {"message": f"The model `{body['model']}` does not exist.", "type": "NotFoundError", "code": 404}
            return JSONResponse({"error": error}, status_code=404)
        n = body["max_tokens"]
        usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}

        async def stream():
            for _ in range(n):
                yield sse(chunk(body["model"], {"content": "word "}))
            yield sse(chunk(body["model"], usage=usage))
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")


def test_measured_through_the_official_client_every_request_to_its_model_every_failure_counted():
    server = AdapterServer("tiny", {"sql", "pirate"})
    with serving(Starlette(routes=[Route("/v1/chat/completions", server.chat, methods=["POST"])])) as root:
        spec = LoadSpec(
            base_url=f"{root}/v1",
            model="tiny",
            prompt_tokens=LengthDistribution.parse("fixed:3"),
            output_tokens=LengthDistribution.parse("fixed:2"),
        )
        cold, mixes = asyncio.run(measure_adapters(spec, ["sql", "pirate", "nope"], concurrency=1, requests=6))
    assert [(c.adapter, c.first_ms is not None, c.warm_ms is not None, c.error) for c in cold] == [
        ("tiny:sql", True, True, None),
        ("tiny:pirate", True, True, None),
        ("tiny:nope", False, False, "NotFoundError (404)"),
    ]
    assert server.models[:6] == ["tiny:sql"] * 2 + ["tiny:pirate"] * 2 + ["tiny:nope"] * 2
    # One in flight: the requests arrive in the order sent, cycling over each mix's models.
    assert server.models[6:12] == ["tiny"] * 6
    assert server.models[12:18] == ["tiny:sql", "tiny:pirate", "tiny:nope"] * 2
    assert server.models[18:] == ["tiny", "tiny:sql", "tiny:pirate", "tiny:nope"] * 1 + ["tiny", "tiny:sql"]
    by_mix = {m.mix: m for m in mixes}
    assert [(m.summary.requests, m.summary.ok) for m in mixes] == [(6, 6), (6, 4), (6, 5)]
    assert by_mix["adapters"].summary.errors == {"NotFoundError (404)": 2}
    assert by_mix["base"].vs_base == 1.0 and by_mix["base"].summary.output_tokens == 12
    assert failed_requests(cold, mixes) == 1 + 2 + 1


def llmctl_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "llmctl"), "bench", *args],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )


def test_llmctl_bench_adapters_prints_both_tables_and_writes_the_report(tmp_path):
    server = AdapterServer("tiny", {"sql"})
    out = tmp_path / "adapters.json"
    with serving(Starlette(routes=[Route("/v1/chat/completions", server.chat, methods=["POST"])])) as root:
        result = llmctl_bench(
            "--url", root, "-m", "tiny", "--adapters", "sql,nope", "-c", "2", "-n", "4",
            "--output-tokens", "fixed:2", "--out", str(out),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "LoRA cold loads on tiny" in result.stdout and "warm throughput per mix, concurrency 2" in result.stdout
    report = AdapterBenchReport.model_validate_json(out.read_text())
    assert report.command.startswith("llmctl bench --url") and report.adapters == ["sql", "nope"]
    assert [(m.mix, m.summary.requests) for m in report.mixes] == [("base", 4), ("adapters", 4), ("base+adapters", 4)]
    assert report.failed == 1 + 2 + 1  # tiny:nope's cold load, and each time a mix sent to it
    assert server.models[0] == "tiny"  # the warm-up: the base, before anything is timed


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--adapters", "sql"], "--adapters needs --model"),
        (["-m", "tiny", "--adapters", "sql", "--rate", "2"], "not with --rate"),
        (["-m", "tiny", "--adapters", "sql", "-c", "1,4"], "one concurrency"),
        (["-m", "tiny", "--adapters", "sql,sql"], "given twice"),
    ],
)
def test_llmctl_bench_adapters_refuses_options_that_do_not_apply(options, says):
    result = llmctl_bench("--url", "http://127.0.0.1:9/v1", *options)
    assert result.returncode == 2 and says in result.stderr, result.stderr
