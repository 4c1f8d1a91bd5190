"""Batch API benchmark: a batch's throughput against the same requests sent online, and interactive
TTFT while a batch runs, through a real gateway process, redis-server and the stub upstream.

    python -m ops.benchmarks.batch [--lines 1000] [--concurrency 32] [--service-ms 320] \
        [--out build/bench/batch.json]

The stub upstream (ops.harness.stub_upstream) answers each request after `service-ms` (a
non-streamed answer waits its whole stream's time; a stream's first chunk comes after one
interval, as prefill), so the model's side is a fixed latency with no capacity limit and the
figures are the gateway's: its admission, fair queue and, for batches, the work queue. The model
has a fair-queue capacity of `concurrency` requests (`model_queues`), as a stack with one replica
of that many `max_ongoing_requests` would give it.

- `online`: `lines` chat completions at `concurrency` (asyncio + httpx), the baseline;
- `batch`: the same requests as one batch, gateway.batch.workers = `concurrency`, timed from
  create to completed (validation and finalization included); the batch tier's
  `capacity_share` is 1 here, so the batch may use the whole capacity when nothing else runs;
- `interactive_alone` / `interactive_during_batch`: an online key (the standard tier) streaming
  at concurrency 2, alone and while a batch of three times `lines` runs (default tiers: the
  batch tier may fill 75% of the capacity), TTFT from the request to the first byte of the stream.

Targets (issue "OpenAI Batch API"): batch throughput >= 0.9x online at c=32; interactive p99
TTFT during the batch <= 1.1x alone. Absolute figures are this machine's (2 shared cores, the
load generator on the same cores); the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from ops.devstack.local_redis import running_redis
from ops.harness.processes import background, free_port, wait_for_http
from ops.harness.stub_gateway import gateway_env
from serving.gateway.auth.keys import create_key_sync

MODEL = "tiny"
CHUNKS = 16
GENEROUS = {
    "requests_per_minute": 10**6,
    "tokens_per_minute": 10**9,
    "daily_token_budget": 10**12,
    "max_concurrent_requests": 1000,
}
HANG_BOUND_S = 600


def body(service_ms: int, stream: bool = False) -> dict[str, Any]:
    steer = json.dumps({"chunks": CHUNKS, "interval_ms": max(1, service_ms // CHUNKS)})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"#stub {steer} hello"}],
        "max_tokens": CHUNKS,
        **({"stream": True} if stream else {}),
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def gateway(
    stack: ExitStack, logs: Path, upstream: str, redis_url: str, concurrency: int, batch_share: float
) -> Iterator[str]:
    port = free_port()
    tiers = [
        {"name": "interactive", "queue_timeout_s": 300},
        {"name": "standard", "queue_timeout_s": 300},
        {"name": "batch", "max_queue_length": 4096, "queue_timeout_s": 600, "capacity_share": batch_share},
    ]
    settings = {
        "models": [MODEL],
        "batch_storage_url": f"file://{logs / 'files'}",
        "batch": {"workers": concurrency, "sweep_interval_s": 0.2},
        "queue": {"tiers": tiers, "default_tier": "standard"},
        "model_queues": {MODEL: {"max_ongoing_requests": concurrency, "max_replicas": 1}},
        "max_connections": 1024,
    }
    env = gateway_env(upstream=upstream, redis_url=redis_url, port=port, settings=settings)
    with background([sys.executable, "-m", "serving.gateway"], logs / f"gateway-{port}.log", env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/healthz", proc, 60)
        yield url


async def online(url: str, key: str, lines: int, concurrency: int, service_ms: int) -> dict[str, Any]:
    payload = body(service_ms)
    todo = iter(range(lines))
    statuses: list[int] = []

    async def client(http: httpx.AsyncClient) -> None:
        for _ in todo:
            response = await http.post(
                f"{url}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}
            )
            statuses.append(response.status_code)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=HANG_BOUND_S, limits=httpx.Limits(max_connections=concurrency)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "requests": lines,
        "seconds": round(elapsed, 2),
        "per_second": round(lines / elapsed, 1),
        "non_200": sum(1 for s in statuses if s != 200),
    }


def start_batch(url: str, key: str, lines: int, service_ms: int) -> tuple[str, float]:
    content = "".join(
        json.dumps(
            {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body(service_ms)}
        )
        + "\n"
        for n in range(lines)
    ).encode()
    headers = {"Authorization": f"Bearer {key}"}
    uploaded = httpx.post(
        f"{url}/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=60
    ).json()
    started = time.perf_counter()
    batch = httpx.post(
        f"{url}/v1/batches",
        headers=headers,
        timeout=60,
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    return batch["id"], started


def wait_batch(url: str, key: str, batch_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + HANG_BOUND_S
    while time.monotonic() < deadline:
        batch = httpx.get(f"{url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}, timeout=60).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise RuntimeError(f"batch {batch_id} did not finish in {HANG_BOUND_S} s")


def run_batch(url: str, key: str, lines: int, service_ms: int) -> dict[str, Any]:
    batch_id, started = start_batch(url, key, lines, service_ms)
    batch = wait_batch(url, key, batch_id)
    elapsed = time.perf_counter() - started
    counts = batch["request_counts"]
    return {
        "requests": lines,
        "seconds": round(elapsed, 2),
        "per_second": round(lines / elapsed, 1),
        "status": batch["status"],
        "completed": counts["completed"],
        "failed": counts["failed"],
    }


async def interactive(url: str, key: str, requests: int, service_ms: int) -> dict[str, Any]:
    payload = body(service_ms, stream=True)
    ttfts: list[float] = []
    todo = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for _ in todo:
            started = time.perf_counter()
            async with http.stream(
                "POST", f"{url}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}
            ) as response:
                first = True
                async for _chunk in response.aiter_raw():
                    if first:
                        ttfts.append(time.perf_counter() - started)
                        first = False

    async with httpx.AsyncClient(timeout=HANG_BOUND_S) as http:
        await asyncio.gather(client(http), client(http))
    return {
        "requests": requests,
        "ttft_p50_ms": round(1000 * (percentile(ttfts, 0.5) or 0), 1),
        "ttft_p99_ms": round(1000 * (percentile(ttfts, 0.99) or 0), 1),
    }


def run(lines: int, concurrency: int, service_ms: int, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"lines": lines, "concurrency": concurrency, "service_ms": service_ms}
    with (
        tempfile.TemporaryDirectory(prefix="llmstack-bench-batch-") as folder,
        running_redis() as redis_server,
        ExitStack() as stack,
    ):
        logs = Path(folder)
        upstream_port = free_port()
        upstream_proc = stack.enter_context(
            background(
                [sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(upstream_port)], logs / "upstream.log"
            )
        )
        upstream = f"http://127.0.0.1:{upstream_port}"
        wait_for_http(f"{upstream}/v1/models", upstream_proc, 60)
        batch_key = create_key_sync(redis_server.url, "batch-co", "bench", limits=GENEROUS)
        online_key = create_key_sync(redis_server.url, "online-co", "bench", limits=GENEROUS)
        with gateway(stack, logs, upstream, redis_server.url, concurrency, batch_share=1.0) as url:
            asyncio.run(online(url, online_key, min(lines, 200), concurrency, service_ms))  # warm up
            results["online"] = asyncio.run(online(url, online_key, lines, concurrency, service_ms))
            results["batch"] = run_batch(url, batch_key, lines, service_ms)
        with gateway(stack, logs, upstream, redis_server.url, concurrency, batch_share=0.75) as url:
            probes = max(50, lines // 10)
            results["interactive_alone"] = asyncio.run(interactive(url, online_key, probes, service_ms))
            batch_id, _ = start_batch(url, batch_key, lines * 3, service_ms)
            time.sleep(1.0)  # the batch's lines fill their share of the capacity
            results["interactive_during_batch"] = asyncio.run(interactive(url, online_key, probes, service_ms))
            results["batch_during_probes"] = httpx.get(
                f"{url}/v1/batches/{batch_id}", timeout=60, headers={"Authorization": f"Bearer {batch_key}"}
            ).json()["status"]
            httpx.post(
                f"{url}/v1/batches/{batch_id}/cancel", headers={"Authorization": f"Bearer {batch_key}"}, timeout=60
            )
    results["batch_vs_online"] = round(results["batch"]["per_second"] / results["online"]["per_second"], 3)
    alone = results["interactive_alone"]["ttft_p99_ms"]
    results["interactive_p99_ttft_during_vs_alone"] = (
        round(results["interactive_during_batch"]["ttft_p99_ms"] / alone, 3) if alone else None
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--service-ms", type=int, default=320)
    parser.add_argument("--out", type=Path, default=Path("build/bench/batch.json"))
    args = parser.parse_args(argv)
    print(json.dumps(run(args.lines, args.concurrency, args.service_ms, args.out), indent=2))


if __name__ == "__main__":
    main()
