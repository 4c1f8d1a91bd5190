"""Fair queue benchmark: noisy neighbour, Jain's fairness index and tiers, against a real redis-server
and an upstream stub with finite capacity, from two load processes that act as two gateway replicas.

    python -m ops.benchmarks.fair_queue [--duration 30] [--capacity 8] [--service-ms 500] \
        [--out build/bench/fair_queue.json]

The upstream (`python -m ops.benchmarks.fair_queue upstream`) serves at most `capacity` requests
at once and queues the rest first come, first served, as Ray Serve and vLLM do: each request
holds its place for `service-ms` (a first chunk after a tenth of it, as prefill, then the rest).
It records the most requests it ever ran at once, the check that the queue never admitted more
than capacity across both load processes.

Each load process calls `FairQueue.acquire` (the gateway's admission takes a free slot by the
same rule in the limiter's round trip, and calls `acquire` when none was free) and then the
upstream, so the figures are the queue's, not the gateway's HTTP layer's (its overhead is the
gateway benchmark's to measure). TTFT here is from the request's start,
queue wait included, to the first chunk. Scenarios, each with fresh Redis keys:

- `b_alone`: tenant B at 10% of capacity, open loop (Poisson arrivals);
- `noisy_fcfs`: A floods at 2x capacity beside B, no queue (today: straight to the upstream);
- `noisy_fair`: the same load through the fair queue;
- `jain`: 4 equal tenants, each keeping `capacity` requests outstanding (all backlogged);
- `interactive_alone` / `interactive_vs_batch`: an interactive key at 10% of capacity, alone and
  while a batch key keeps 3x capacity outstanding (the batch tier may fill 75% of the capacity,
  the default `capacity_share`).

Targets (issue "fair, prioritized admission"): B's p99 TTFT in `noisy_fair` <= 1.5x `b_alone`,
no 5xx, A served at least its fair share; Jain >= 0.9; interactive p99 TTFT under batch load
<= 1.2x alone; the upstream's peak concurrency <= capacity. Absolute figures are this machine's
(2 shared cores); the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

MODEL = "tiny"
PROCESSES = 2


# --- the upstream: finite capacity, first come first served -----------------------------------------


def upstream_app(capacity: int, service_s: float, tokens: int = 16, spread: float = 0.0):
    """At most `capacity` requests run at once, the rest wait first come first served (as Ray
    Serve's router and vLLM's scheduler do). A running request streams OpenAI chunks: the first
    after a tenth of `service_s` (prefill), then `tokens` more at a fixed pace. /stats says how
    many ran at once (`running`, `peak`) and how many waited here for a place (`fifo_waited`):
    behind a queue that works, nothing waits here. `spread`: each request's decode time is drawn
    uniformly within +-spread of its mean (answers differ in length), so that requests admitted
    together do not all finish together."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    slots = asyncio.Semaphore(capacity)  # wakes waiters in arrival order
    stats = {"running": 0, "peak": 0, "served": 0, "fifo_waited": 0, "fifo_wait_max_s": 0.0}
    step = service_s * 9 / 10 / tokens
    lengths = random.Random(0)

    def chunk(model: str, delta: dict | None, usage: dict | None = None, **extra: float) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
        return (
            b"data: "
            + json.dumps(
                {
                    "id": "chatcmpl-fq",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": model,
                    "choices": choices,
                    "usage": usage,
                    **extra,
                }
            ).encode()
            + b"\n\n"
        )

    async def chat(request):
        body = await request.json()
        model = body.get("model", MODEL)
        usage = {"prompt_tokens": 5, "completion_tokens": tokens + 1, "total_tokens": tokens + 6}

        async def take_a_place() -> None:
            arrived, full = time.monotonic(), slots.locked()
            await slots.acquire()
            if full:
                stats["fifo_waited"] += 1
                stats["fifo_wait_max_s"] = max(stats["fifo_wait_max_s"], time.monotonic() - arrived)
            stats["running"] += 1
            stats["peak"] = max(stats["peak"], stats["running"])

        def leave(served: bool) -> None:
            stats["running"] -= 1
            stats["served"] += served
            slots.release()

        if not body.get("stream"):
            await take_a_place()
            try:
                await asyncio.sleep(service_s)
            finally:
                leave(True)
            return JSONResponse(
                {
                    "id": "chatcmpl-fq",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "usage": usage,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "a" * (tokens + 1)},
                        }
                    ],
                }
            )
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True

        arrived = time.time()  # wall clock, so a client on this machine can split its TTFT

        async def stream():
            await take_a_place()
            served = False
            try:
                await asyncio.sleep(service_s / 10)
                yield chunk(model, {"role": "assistant", "content": "a"}, arrived=arrived, first_at=time.time())
                pace = step * lengths.uniform(1 - spread, 1 + spread)
                for _ in range(tokens):
                    await asyncio.sleep(pace)
                    yield chunk(model, {"content": "a"})
                if include_usage:
                    yield chunk(model, None, usage)
                served = True
            finally:
                leave(served)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def read_stats(request):
        if request.method == "POST":
            stats.update(peak=stats["running"], served=0, fifo_waited=0, fifo_wait_max_s=0.0)
        return JSONResponse(stats)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/stats", read_stats, methods=["GET", "POST"]),
        ]
    )


# --- load: one process is one gateway replica ------------------------------------------------------


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when every tenant got the same, 1/n when one got everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return 0.0 if squares == 0 else total * total / (len(values) * squares)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def load_process(scenario: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return asyncio.run(_load(scenario, index))


# Complex on purpose: a benchmark client's loop: send, classify each outcome, record.
async def _load(scenario: dict[str, Any], index: int) -> list[dict[str, Any]]:  # noqa: C901
    import httpx

    from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
    from serving.gateway.queue.fair_queue import FairQueue, QueueRefused

    loop = asyncio.get_running_loop()
    queue = None
    if scenario["queue"]:
        policy = QueuePolicy(
            tiers=[
                QueueTier(name="interactive", queue_timeout_s=120),
                QueueTier(name="standard", max_queue_length=64, queue_timeout_s=120),
                QueueTier(name="batch", max_queue_length=64, queue_timeout_s=120, capacity_share=0.75),
            ],
            reserve_share=scenario["reserve_share"],
        )
        queue = FairQueue(
            scenario["redis_url"], policy, {scenario["model"]: ModelQueue(max_ongoing_requests=scenario["capacity"])}
        )
        await queue.start()
    records: list[dict[str, Any]] = []
    client = httpx.AsyncClient(
        base_url=scenario["upstream"],
        timeout=300,
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
    )
    start = loop.time()
    stop_at = start + scenario["duration"]

    async def one(tenant: str, tier: str) -> None:
        sent = loop.time()
        record: dict[str, Any] = {"tenant": tenant, "sent": sent - start}
        ticket = None
        try:
            if queue is not None:
                ticket = await queue.acquire(scenario["model"], tenant, tier=tier)
            record["wait"] = loop.time() - sent
            async with client.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True}) as response:
                async for _ in response.aiter_raw():
                    record.setdefault("ttft", loop.time() - sent)
            record["status"] = response.status_code
        except QueueRefused as refused:
            record["status"] = refused.refusal.status
        except httpx.HTTPError as exc:
            record["status"], record["error"] = 0, type(exc).__name__
        finally:
            if ticket is not None:
                await ticket.release()
        record["done"] = loop.time() - start
        records.append(record)

    async def open_loop(tenant: str, tier: str, rate: float) -> None:
        rng, pending = random.Random(f"{tenant}{index}"), []
        while True:
            await asyncio.sleep(rng.expovariate(rate))
            if loop.time() >= stop_at:
                break
            pending.append(asyncio.create_task(one(tenant, tier)))
        await asyncio.gather(*pending)

    async def closed_loop(tenant: str, tier: str, outstanding: int) -> None:
        async def caller() -> None:
            while loop.time() < stop_at:
                await one(tenant, tier)

        await asyncio.gather(*(caller() for _ in range(outstanding)))

    per_process = 1 / PROCESSES
    jobs = []
    for load in scenario["loads"]:
        if load["kind"] == "open":
            jobs.append(open_loop(load["tenant"], load["tier"], load["rate"] * per_process))
        else:
            jobs.append(closed_loop(load["tenant"], load["tier"], max(1, round(load["outstanding"] * per_process))))
    try:
        await asyncio.gather(*jobs)
    finally:
        await client.aclose()
        if queue is not None:
            await queue.aclose()
    return records


# --- scenarios and figures ---------------------------------------------------------------------------


def scenarios(capacity: int, service_s: float) -> dict[str, dict[str, Any]]:
    full_rate = capacity / service_s  # requests/s the upstream completes when busy
    b = {"kind": "open", "tenant": "b", "tier": "standard", "rate": 0.1 * full_rate}
    a = {"kind": "open", "tenant": "a", "tier": "standard", "rate": 2.0 * full_rate}
    interactive = {"kind": "open", "tenant": "interactive", "tier": "interactive", "rate": 0.1 * full_rate}
    batch = {"kind": "closed", "tenant": "batch", "tier": "batch", "outstanding": 3 * capacity}
    return {
        "b_alone": {"queue": True, "loads": [b]},
        "noisy_fcfs": {"queue": False, "loads": [a, b]},
        "noisy_fair": {"queue": True, "loads": [a, b]},
        "jain": {
            "queue": True,
            "loads": [
                {"kind": "closed", "tenant": f"t{i}", "tier": "standard", "outstanding": capacity} for i in range(4)
            ],
        },
        "interactive_alone": {"queue": True, "loads": [interactive]},
        "interactive_vs_batch": {"queue": True, "loads": [batch, interactive]},
    }


def served(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests answered: a 200 and a first chunk."""
    return [r for r in records if r.get("status") == 200 and "ttft" in r]


def summary_of(mine: list[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """One group of requests (a tenant's, or a probe's in one phase): outcomes, TTFT and queue-wait
    percentiles of those served, and how many were served within `window` (s since the start).
    A wait below 0 is one the client could not read (no x-queue-wait-ms)."""
    ok = served(mine)
    ttfts = [r["ttft"] for r in ok]
    waits = [r["wait"] for r in ok if r.get("wait", -1) >= 0]
    return {
        "sent": len(mine),
        "ok": len(ok),
        "status_429": sum(r.get("status") == 429 for r in mine),
        "status_5xx": sum(r.get("status", 0) >= 500 or r.get("status") == 0 for r in mine),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "queue_wait_p50_s": percentile(waits, 50),
        "queue_wait_p99_s": percentile(waits, 99),
        "served_in_window": sum(window[0] <= r["done"] <= window[1] for r in ok),
    }


def summarize(records: list[dict[str, Any]], tenants: list[str], window: tuple[float, float]) -> dict[str, Any]:
    return {tenant: summary_of([r for r in records if r["tenant"] == tenant], window) for tenant in tenants}


def run(duration: float, capacity: int, service_s: float, out: Path, reserve_share: float = 0.25) -> dict[str, Any]:
    import httpx

    from ops.devstack.local_redis import start_redis
    from ops.harness.processes import background, free_port, wait_for_http

    results: dict[str, Any] = {
        "duration_s": duration,
        "capacity": capacity,
        "service_s": service_s,
        "reserve_share": reserve_share,
        "processes": PROCESSES,
        "scenarios": {},
    }
    redis_server = start_redis()
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="llmstack-fq-bench-"))
    try:
        with background(
            [
                sys.executable,
                "-m",
                "ops.benchmarks.fair_queue",
                "upstream",
                "--port",
                str(port),
                "--capacity",
                str(capacity),
                "--service-ms",
                str(int(service_s * 1000)),
            ],
            logs / "upstream.log",
        ) as upstream:
            base = f"http://127.0.0.1:{port}"
            wait_for_http(f"{base}/stats", upstream, timeout_s=60)
            with ProcessPoolExecutor(PROCESSES, mp_context=get_context("spawn")) as pool:
                for name, scenario in scenarios(capacity, service_s).items():
                    httpx.post(f"{base}/stats")
                    scenario = {
                        **scenario,
                        "redis_url": redis_server.url,
                        "upstream": base,
                        "capacity": capacity,
                        "duration": duration,
                        "model": f"bench-{name}-{time.time_ns()}",
                        "reserve_share": reserve_share,
                    }
                    records = [
                        r for part in pool.map(load_process, [scenario] * PROCESSES, range(PROCESSES)) for r in part
                    ]
                    upstream_stats = httpx.get(f"{base}/stats").json()
                    tenants = sorted({load["tenant"] for load in scenario["loads"]})
                    # Skip the first fifth (filling the queue) and the drain after the load stops.
                    summary = summarize(records, tenants, (duration / 5, duration))
                    results["scenarios"][name] = {"tenants": summary, "upstream_peak": upstream_stats["peak"]}
                    print(
                        f"{name}: upstream peak {upstream_stats['peak']}/{capacity}; "
                        + "; ".join(
                            f"{t} ok {s['ok']}/{s['sent']} 429 {s['status_429']} 5xx {s['status_5xx']} "
                            f"ttft p99 {s['ttft_p99_s'] or 0:.3f}s "
                            f"(wait {s['queue_wait_p99_s'] or 0:.3f}s)"
                            for t, s in summary.items()
                        ),
                        flush=True,
                    )
    finally:
        redis_server.stop()
    results["figures"] = figures(results["scenarios"], capacity, service_s, duration)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return results


def figures(s: dict[str, Any], capacity: int, service_s: float, duration: float) -> dict[str, Any]:
    def p99(scenario: str, tenant: str) -> float:
        return s[scenario]["tenants"][tenant]["ttft_p99_s"] or float("nan")

    window_s = duration - duration / 5
    full = capacity / service_s * window_s  # requests the upstream can complete in the window
    jain = [s["jain"]["tenants"][f"t{i}"]["served_in_window"] for i in range(4)]
    return {
        "b_p99_ratio_fair_vs_alone": p99("noisy_fair", "b") / p99("b_alone", "b"),
        "b_p99_ratio_fcfs_vs_alone": p99("noisy_fcfs", "b") / p99("b_alone", "b"),
        "noisy_fair_5xx": sum(t["status_5xx"] for t in s["noisy_fair"]["tenants"].values()),
        "a_share_of_capacity_fair": s["noisy_fair"]["tenants"]["a"]["served_in_window"] / full,
        "jain_index": jain_index(jain),
        "interactive_p99_ratio_vs_alone": p99("interactive_vs_batch", "interactive")
        / p99("interactive_alone", "interactive"),
        "upstream_peak_max_with_queue": max(v["upstream_peak"] for k, v in s.items() if k != "noisy_fcfs"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", choices=["bench", "upstream"], default="bench")
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--service-ms", type=int, default=500)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--spread", type=float, default=0.0, help="upstream: decode time within +-this fraction")
    parser.add_argument("--out", type=Path, default=Path("build/bench/fair_queue.json"))
    # As in ops.benchmarks.fair_queue_gateway: 2 of 8 slots, B's peak concurrency here.
    parser.add_argument("--reserve-share", type=float, default=0.25, help="gateway.queue.reserve_share")
    args = parser.parse_args(argv)
    if args.role == "upstream":
        import uvicorn

        uvicorn.run(
            upstream_app(args.capacity, args.service_ms / 1000, spread=args.spread),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
        )
        return
    results = run(args.duration, args.capacity, args.service_ms / 1000, args.out, args.reserve_share)
    print(json.dumps(results["figures"], indent=2))


if __name__ == "__main__":
    main()
