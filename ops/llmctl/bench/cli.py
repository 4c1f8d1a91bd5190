"""`llmctl bench`: load any OpenAI-compatible endpoint and report what its users would see.

Thin shell: options -> `LoadSpec`, `ops.llmctl.bench.loadgen` measures, `ops.llmctl.bench.stats` summarises,
`ops.llmctl.bench.plot` draws. With `--adapters`, `ops.llmctl.bench.adapters` measures LoRA adapters'
cold loads and the throughput of adapter mixes instead. Exit codes: 0 measured (failed requests
are reported, not fatal), 1 no request of the run succeeded, 2 unusable options or an endpoint
that cannot be used.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlsplit

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ops.llmctl.console import ExitCode, err, out

if TYPE_CHECKING:  # openai and numpy load only when bench runs: `llmctl plan` needs neither
    from ops.llmctl.bench.adapters import AdapterBenchReport
    from ops.llmctl.bench.loadgen import LoadSpec
    from ops.llmctl.bench.stats import BenchReport, LengthDistribution, LevelSummary
    from ops.llmctl.bench.workers import WorkerPool


class Api(str, Enum):
    chat = "chat"
    completions = "completions"


class Workload(str, Enum):
    single = "single"
    multiturn = "multiturn"


class BenchError(Exception):
    """An option or endpoint problem, said in one line with its fix."""


def normalise_base_url(url: str) -> str:
    """`http://host:8080` -> `http://host:8080/v1` (the OpenAI clients' base URL); a URL that
    already has a path is kept as given (gateways may mount the API elsewhere)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"--url {url!r} is not an http(s) URL; e.g. --url http://127.0.0.1:8080/v1")
    return url.rstrip("/") + ("/v1" if parts.path in ("", "/") else "")


def load_levels(concurrency: str | None, rate: str | None) -> tuple[Literal["concurrency", "rate"], list[float]]:
    from ops.llmctl.bench.stats import parse_levels

    if concurrency and rate:
        raise BenchError("give --concurrency or --rate, not both")
    try:
        if rate:
            return "rate", parse_levels(rate)
        levels = parse_levels(concurrency or "1,4,16")
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if any(v != int(v) for v in levels):
        raise BenchError(f"--concurrency {concurrency!r}: concurrency levels are whole numbers, e.g. 1,4,16")
    return "concurrency", levels


def _distribution(option: str, text: str) -> LengthDistribution:
    from ops.llmctl.bench.stats import LengthDistribution

    try:
        return LengthDistribution.parse(text)
    except ValueError as exc:
        raise BenchError(f"{option}: {exc}") from None


async def _pick_model(spec: LoadSpec) -> str:
    from ops.llmctl.bench.loadgen import make_client
    from ops.llmctl.bench.stats import error_type

    try:
        async with make_client(spec) as client:
            models = [m.id async for m in client.models.list()]
    except Exception as exc:  # noqa: BLE001 - any failure of the SDK call is reported, by its type
        kind = error_type(exc)
        raise BenchError(f"listing models at {spec.base_url} failed: {kind}: {exc}; {_hint(kind)}") from None
    if not models:
        raise BenchError(f"{spec.base_url}/models lists no model; pass --model")
    return models[0]


async def _warm_up(spec: LoadSpec) -> None:
    """One short request outside the measurement: loads lazily built server state, and
    turns a wrong URL, key or model into one clear line before any level starts."""
    from ops.llmctl.bench.loadgen import make_client, one_request

    async with make_client(spec) as client:
        result = await one_request(client, spec, "hello", 4)
    if result.error is not None:
        raise BenchError(
            f"warm-up request to {spec.base_url} failed: {result.error}: {result.error_message}; {_hint(result.error)}"
        )


_HINTS = {
    "AuthenticationError": "pass the endpoint's key with --api-key or OPENAI_API_KEY",
    "PermissionDeniedError": "this key may not use that model; check --model and the key's models",
    "NotFoundError": "check --model (see GET /v1/models) and that --url ends in the API's /v1",
    "APIConnectionError": "is the server running there? (`make dev` prints its base URL)",
    "APITimeoutError": "the server did not answer in --timeout seconds; is it overloaded?",
    "BadRequestError": "the server refused the request; try --no-ignore-eos or --api completions",
    "RateLimitError": "the key's limits are exhausted; wait, or use a key with higher limits",
}


def _hint(kind: str) -> str:
    return next((hint for name, hint in _HINTS.items() if kind.startswith(name)), "see the server's log")


def cpu_roots(explicit: list[int] | None) -> list[int]:
    """Processes whose CPU `--cpu-layers` counts (with their descendants): the ones given, else
    the running `make dev` of this checkout; this process (the client) always."""
    from ops.devstack.lock import NOT_RUNNING, find_running_dev, lock_path

    if explicit:
        return [os.getpid(), *explicit]
    dev = find_running_dev()
    if dev is None:
        raise BenchError(NOT_RUNNING.format(path=lock_path()) + "; or name the server's process with --cpu-root PID")
    return [os.getpid(), dev.pid]


async def _measure(
    spec: LoadSpec,
    mode: Literal["concurrency", "rate"],
    levels: list[float],
    warm_up: bool,
    roots: list[int] | None = None,
    processes: int = 1,
) -> list[LevelSummary]:
    from ops.llmctl.bench.workers import WorkerPool

    if warm_up:
        await _warm_up(spec)
    if processes == 1:
        return await _levels(spec, mode, levels, roots, None)
    # Started once and kept for every level, so --cpu-layers counts them while they send.
    async with WorkerPool(processes) as pool:
        return await _levels(spec, mode, levels, roots, pool)


async def _levels(
    spec: LoadSpec,
    mode: Literal["concurrency", "rate"],
    levels: list[float],
    roots: list[int] | None,
    pool: WorkerPool | None,
) -> list[LevelSummary]:
    from ops.llmctl.bench.cpu_layers import CpuSampler, cpu_ms_per_token
    from ops.llmctl.bench.loadgen import run_level
    from ops.llmctl.bench.stats import default_requests, summarise

    summaries = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=err,
        transient=False,
    ) as progress:
        for level in levels:
            level_spec = (
                spec
                if spec.requests or spec.duration_s
                else spec.model_copy(update={"requests": default_requests(mode, level)})
            )
            label = f"{mode} {level:g}" + ("/s" if mode == "rate" else "")
            by_time = level_spec.requests is None
            task = progress.add_task(label, total=level_spec.duration_s if by_time else level_spec.requests, status="")
            failed = 0
            started = time.monotonic()

            def done(result, task=task, by_time=by_time) -> None:
                nonlocal failed
                failed += result.error is not None
                progress.update(task, advance=0 if by_time else 1, status=f"{failed} failed" if failed else "")

            async def tick(task=task, started=started, level_spec=level_spec) -> None:  # advance with the clock
                while True:
                    progress.update(task, completed=min(time.monotonic() - started, level_spec.duration_s))
                    await asyncio.sleep(0.5)

            ticker = asyncio.create_task(tick()) if by_time else None
            sampler = CpuSampler(roots, include_self=True) if roots else None
            if sampler:
                sampler.start()
            results = await (
                pool.run_level(level_spec, mode, level, on_result=done)
                if pool is not None
                else run_level(level_spec, mode, level, on_result=done)
            )
            cpu = sampler.stop() if sampler else None
            if ticker:
                ticker.cancel()
            summary = summarise(results, mode, level)
            if cpu is not None:
                summary = summary.model_copy(
                    update={"cpu_ms_per_output_token": cpu_ms_per_token(cpu, summary.output_tokens)}
                )
            summaries.append(summary)
            progress.console.print(
                f"  {label}: {summary.ok} ok, {summary.requests - summary.ok} failed, "
                f"{summary.output_throughput:,.0f} output tok/s",
                highlight=False,
            )
    return summaries


def results_table(report: BenchReport) -> Table:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    def ms1(value: float | None) -> str:  # per-token gaps are a few ms: keep a decimal
        return "-" if value is None else f"{value:,.1f}"

    table = Table(title=f"llmctl bench: {report.model} at {report.base_url}", title_justify="left")
    for name in (
        report.mode,
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "E2E p50",
        "E2E p90",
        "E2E p99",
    ):
        table.add_column(name, justify="right")
    cached = any(s.prefix_cache_hit_rate is not None for s in report.levels)
    if cached:
        table.add_column("cache hit", justify="right")
    table.add_column("errors")
    for s in report.levels:
        hit = [] if not cached else ["-" if s.prefix_cache_hit_rate is None else f"{s.prefix_cache_hit_rate:.1%}"]
        table.add_row(
            f"{s.level:g}",
            str(s.ok),
            str(s.requests - s.ok),
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:,.0f}",
            ms(s.ttft_ms.p50),
            ms(s.ttft_ms.p99),
            ms1(s.itl_ms.p50),
            ms1(s.itl_ms.p99),
            ms1(s.tpot_ms.p50),
            ms(s.e2e_ms.p50),
            ms(s.e2e_ms.p90),
            ms(s.e2e_ms.p99),
            *hit,
            ", ".join(f"{k}: {v}" for k, v in s.errors.items()),
        )
    return table


def cpu_table(report: BenchReport) -> Table | None:
    """CPU-ms per output token by layer, one column per level; None without --cpu-layers."""
    from ops.llmctl.bench.cpu_layers import LAYERS, PARTS

    levels = [s for s in report.levels if s.cpu_ms_per_output_token]
    if not levels:
        return None
    table = Table(title="CPU-ms per output token, by layer", title_justify="left")
    table.add_column("layer")
    for s in levels:
        table.add_column(f"{report.mode} {s.level:g}", justify="right")
    for layer in (*LAYERS, "serving layers", "total", *PARTS):
        table.add_row(layer, *(f"{s.cpu_ms_per_output_token.get(layer, 0):.3f}" for s in levels))
    return table


def _bench_adapters(
    spec: LoadSpec,
    command: str,
    adapters: str,
    concurrency: str | None,
    rate: str | None,
    requests: int | None,
    duration: float | None,
    workload: Workload,
    cpu_layers: bool,
) -> AdapterBenchReport:
    """`--adapters`: check the options that apply, warm the base, measure (`ops.llmctl.bench.adapters`)."""
    from ops.llmctl.bench.adapters import bench_adapters, parse_adapters

    if spec.model == "?":
        raise BenchError("--adapters needs --model: the base model's served name, e.g. -m tiny-chat")
    if rate or duration or workload is not Workload.single or cpu_layers:
        raise BenchError(
            "--adapters runs a closed loop of a request count: not with --rate, --duration, "
            "--workload multiturn or --cpu-layers"
        )
    try:
        ids = parse_adapters(adapters)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    _, levels = load_levels(concurrency or "8", None)
    if len(levels) != 1:
        raise BenchError(f"--adapters measures at one concurrency: give one -c value, not {concurrency!r}")
    level = int(levels[0])

    async def main() -> AdapterBenchReport:
        await _warm_up(spec)  # the base loaded before anything is timed; a wrong URL or key is one line
        return await bench_adapters(
            spec,
            ids,
            concurrency=level,
            requests=requests or 64,
            command=command,
            on_phase=lambda phase: err.print(f"  {phase} ...", highlight=False),
        )

    try:
        return asyncio.run(main())
    except BenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. connection refused during the warm-up
        raise BenchError(f"{spec.base_url}: {type(exc).__name__}: {exc}; is the server running there?") from None


def _write_adapter_report(report: AdapterBenchReport, out_path: Path) -> None:
    from ops.llmctl.bench.adapters import adapter_tables

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(report.model_dump_json(indent=2))
    for table in adapter_tables(report):
        out.print(table)
    out.print(f"wrote {out_path}; {report.failed} requests failed", highlight=False)
    if not any(m.summary.ok for m in report.mixes):
        err.print("[red]no request succeeded[/red]; see the errors column", highlight=False)
        raise typer.Exit(ExitCode.FAILED)


def _run_adapters(
    spec_fields: dict[str, object],
    lengths: tuple[str, str],
    command: str,
    adapters: str,
    options: tuple[str | None, str | None, int | None, float | None, Workload, bool],
    out_path: Path | None,
) -> None:
    """`llmctl bench --adapters`: measure, print and write the adapter report; a bad option exits 2.
    `lengths`: --prompt-tokens and --output-tokens as given; `options`: concurrency, rate,
    requests, duration, workload and cpu_layers as given."""
    from ops.llmctl.bench.loadgen import LoadSpec

    try:
        prompt, output = (
            _distribution(flag, text) for flag, text in zip(("--prompt-tokens", "--output-tokens"), lengths)
        )
        spec = LoadSpec.model_validate({**spec_fields, "prompt_tokens": prompt, "output_tokens": output})
        report = _bench_adapters(spec, command, adapters, *options)
    except BenchError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.UNUSABLE_INPUT) from None
    _write_adapter_report(report, out_path or Path("build/bench/adapters.json"))


def bench(
    url: Annotated[
        str,
        typer.Option(
            "--url",
            help="OpenAI base URL: the gateway (http://127.0.0.1:8080/v1), "
            "Ray Serve or bare vLLM. /v1 is added to a URL without a path.",
        ),
    ],
    api_key: Annotated[
        str,
        typer.Option(
            "--api-key",
            envvar="OPENAI_API_KEY",
            show_default=False,
            help="Bearer key (the gateway's). Default: $OPENAI_API_KEY, else none.",
        ),
    ] = "EMPTY",
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model to request. Default: the first one GET /v1/models lists.")
    ] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            "--concurrency",
            "-c",
            help="Closed loop: requests in flight, one level per comma-separated value. Default 1,4,16.",
        ),
    ] = None,
    rate: Annotated[
        str | None,
        typer.Option(
            "--rate",
            "-r",
            help="Open loop instead: Poisson arrivals, requests/s per level, e.g. 2,5,10. Not with --concurrency.",
        ),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests",
            "-n",
            min=1,
            help="Requests per level. Default: 4 x concurrency or 10 s of arrivals, at least 16.",
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            "-d",
            min=0.1,
            help="Seconds of sending per level instead of a count (requests in flight then finish).",
        ),
    ] = None,
    prompt_tokens: Annotated[
        str,
        typer.Option(
            "--prompt-tokens",
            help="Prompt length: fixed:N, uniform:LO-HI or "
            "normal:MEAN,STD (words, about one token each; the report has the server's "
            "count).",
        ),
    ] = "fixed:64",
    output_tokens: Annotated[
        str, typer.Option("--output-tokens", help="max_tokens per request, same forms.")
    ] = "fixed:64",
    api: Annotated[Api, typer.Option("--api", help="chat (/chat/completions) or completions.")] = Api.chat,
    workload: Annotated[
        Workload,
        typer.Option(
            "--workload",
            help="single prompts, or multiturn conversations "
            "(a shared system prompt, then --turns turns each resending the conversation; chat, "
            "--concurrency only): what prefix caching and `routing: prefix` serve.",
        ),
    ] = Workload.single,
    turns: Annotated[int, typer.Option("--turns", min=1, help="multiturn: user turns per conversation.")] = 4,
    system_prompt_tokens: Annotated[
        int,
        typer.Option(
            "--system-prompt-tokens", min=1, help="multiturn: words of the system prompt all conversations share."
        ),
    ] = 256,
    cpu_layers: Annotated[
        bool,
        typer.Option(
            "--cpu-layers",
            help="Also report CPU-ms per output token by "
            "layer (gateway, Serve ingress, replica, engine, ...) of the processes on THIS "
            "machine: the running make dev, or --cpu-root.",
        ),
    ] = False,
    cpu_root: Annotated[
        list[int] | None,
        typer.Option(
            "--cpu-root",
            help="--cpu-layers: a process whose descendants serve the endpoint (repeatable). Default: make dev's.",
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes",
            "-P",
            min=1,
            help="Client processes sharing each level, each with its own AsyncOpenAI: one process "
            "streaming many requests queues them in itself. Default: one per 8 streams (or 8 "
            "requests/s) of the highest level, at most one per core.",
        ),
    ] = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos/--no-ignore-eos",
            help="Ask vLLM for exactly max_tokens (vLLM extension; turn off for other servers).",
        ),
    ] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seeds prompts, lengths and arrival times.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Per-request timeout, seconds.")] = 300,
    warm_up: Annotated[
        bool,
        typer.Option(
            "--warm-up/--no-warm-up",
            help="One short request before measuring (fails fast on a wrong URL, key or model).",
        ),
    ] = True,
    adapters: Annotated[
        str | None,
        typer.Option(
            "--adapters",
            help="LoRA adapter ids of --model, comma-separated: instead of load levels, each adapter's cold "
            "load (its first request against its next) and the warm throughput of the base alone, the "
            "adapters round-robin, and both mixed, at one --concurrency (default 8), --requests per mix "
            "(default 64).",
        ),
    ] = None,
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="JSON report. Default: build/bench/bench.json (--adapters: build/bench/adapters.json)."
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG: latency and throughput vs level. Default: the --out path with .png."),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG.")] = False,
) -> None:
    """Load an OpenAI-compatible endpoint at fixed concurrencies or request rates and report
    throughput (requests/s, tokens/s), TTFT, inter-token and end-to-end latency (p50/p90/p99)
    and errors by type (e.g. `RateLimitError (429)` when a gateway key's limits bite).

    \b
    Examples:
      llmctl bench --url http://127.0.0.1:8080/v1 --api-key sk-llm-... -c 1,4,16
      llmctl bench --url http://127.0.0.1:8000 --rate 2,5 --duration 60 --output-tokens uniform:32-256
      llmctl bench --url http://127.0.0.1:8080/v1 --workload multiturn -c 8 --turns 4 --cpu-layers
      llmctl bench --url http://127.0.0.1:8000/tiny-chat/v1 -m tiny-chat --adapters sql,pirate -c 8 -n 64
    """
    from ops.llmctl.bench.loadgen import LoadSpec
    from ops.llmctl.bench.split import default_processes
    from ops.llmctl.bench.stats import BenchReport
    from ops.llmctl.bench.workers import WorkerDied

    command = "llmctl bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    if adapters is not None:
        base = {"base_url": normalise_base_url(url), "api_key": api_key, "model": model or "?", "api": api.value}
        run = {"ignore_eos": ignore_eos, "seed": seed, "timeout_s": timeout}
        lengths = (prompt_tokens, output_tokens)
        options = (concurrency, rate, requests, duration, workload, cpu_layers)
        _run_adapters({**base, **run}, lengths, command, adapters, options, out_path)
        return
    out_path = out_path or Path("build/bench/bench.json")
    try:
        mode, levels = load_levels(concurrency, rate)
        if requests and duration:
            raise BenchError("give --requests or --duration, not both")
        if workload is Workload.multiturn and (api is not Api.chat or mode != "concurrency"):
            raise BenchError("--workload multiturn holds conversations: use it with --api chat and --concurrency")
        roots = cpu_roots(cpu_root) if cpu_layers else None
        clients = processes or default_processes(mode, levels, os.cpu_count() or 1)
        spec = LoadSpec(
            base_url=normalise_base_url(url),
            api_key=api_key,
            model=model or "?",
            api=api.value,
            prompt_tokens=_distribution("--prompt-tokens", prompt_tokens),
            output_tokens=_distribution("--output-tokens", output_tokens),
            requests=requests,
            duration_s=duration,
            ignore_eos=ignore_eos,
            seed=seed,
            timeout_s=timeout,
            workload=workload.value,
            turns=turns,
            system_prompt_tokens=system_prompt_tokens,
        )
        started_at = datetime.now(UTC).isoformat(timespec="seconds")

        async def main() -> list[LevelSummary]:
            nonlocal spec
            if model is None:
                spec = spec.model_copy(update={"model": await _pick_model(spec)})
            return await _measure(spec, mode, levels, warm_up, roots, clients)

        summaries = asyncio.run(main())
    except BenchError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.UNUSABLE_INPUT) from None
    except WorkerDied as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.FAILED) from None
    except Exception as exc:  # noqa: BLE001 - e.g. connection refused while listing models
        err.print(
            f"[red]error:[/red] {url}: {type(exc).__name__}: {exc}; is the server running there?",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(ExitCode.UNUSABLE_INPUT) from None
    report = BenchReport(
        command=command,
        started_at=started_at,
        base_url=spec.base_url,
        model=spec.model,
        api=spec.api,
        mode=mode,
        workload=workload.value,
        prompt_tokens=str(spec.prompt_tokens),
        output_tokens=str(spec.output_tokens),
        requests_per_level=requests,
        duration_s_per_level=duration,
        ignore_eos=ignore_eos,
        seed=seed,
        client_processes=clients,
        levels=summaries,
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(report.model_dump_json(indent=2))
    out.print(results_table(report))
    layers = cpu_table(report)
    if layers is not None:
        out.print(layers)
    out.print(f"wrote {out_path}", highlight=False)
    if not no_plot:
        from ops.llmctl.bench.plot import plot_report

        out.print(f"wrote {plot_report(report, plot or out_path.with_suffix('.png'))}", highlight=False)
    if not any(s.ok for s in summaries):
        err.print("[red]no request succeeded[/red]; see the errors column", highlight=False)
        raise typer.Exit(ExitCode.FAILED)
