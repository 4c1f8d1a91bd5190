"""Fair queue through the gateway: the noisy-neighbour, fairness and tier scenarios of
ops.benchmarks.fair_queue, sent over HTTP to real gateway processes (`python -m serving.gateway`
under uvicorn) that share one redis-server, in front of that module's fixed-capacity upstream.

    python -m ops.benchmarks.fair_queue_gateway [--duration 30] [--capacity 8] [--service-ms 500] \
        [--out build/bench/fair_queue_gateway.json]

Four gateway processes run side by side: two with the queue (`fair`) and two with it off
(`fcfs`, every admitted request goes straight to the upstream, as before the queue), so the
"before" figure comes from the same run. Each tenant's load comes from two processes, each
sending to its own gateway of the pair, so every queued scenario crosses two gateway replicas,
and no tenant's client shares an event loop with another's (a probe's TTFT is not the flood's
client being busy).
Each scenario has its own model name (its own queue state in Redis); keys are created per
tenant with generous limits, so only the queue decides. The client measures TTFT from sending
the request to the first content chunk (queue wait included) and reads `x-queue-wait-ms`.

The upstream's own counts (`peak` requests running, `fifo_waited`: requests that waited in its
first-come-first-served line) say whether the gateway held the model at its capacity and
whether anything queued behind the gateway, where tiers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ops.benchmarks.fair_queue import jain_index, percentile, served, summary_of
from ops.benchmarks.fair_queue import scenarios as module_scenarios
from ops.harness.stub_gateway import GENEROUS

PROCESSES = 2
TIERS = {"interactive": "interactive", "batch": "batch"}  # tenant -> tier; the rest are standard


def scenarios(capacity: int, service_s: float, interactive_s: float) -> dict[str, dict[str, Any]]:
    """The module benchmark's scenarios, except that the interactive key's "alone" and "beside a
    batch flood" figures come from one scenario: the batch load switches on and off every
    `on_s`, so both halves see the same machine (shared cores make minutes apart incomparable).
    Requests sent while the batch queue fills or drains (`settle_s`) count for neither.
    `noisy_switching` does the same for tenant B beside A's flood; `b_alone` / `noisy_fcfs` /
    `noisy_fair` stay as they were (the "before" figure, A's share, the 5xx count)."""
    plan = {
        name: scenario
        for name, scenario in module_scenarios(capacity, service_s).items()
        if not name.startswith("interactive")
    }
    batch = {
        "kind": "closed",
        "tenant": "batch",
        "tier": "batch",
        "outstanding": 3 * capacity,
        "on_s": 10.0,
        "off_s": 10.0,
        "settle_s": 4.0,
    }
    interactive = {"kind": "open", "tenant": "interactive", "tier": "interactive", "rate": 0.1 * capacity / service_s}
    plan["interactive"] = {
        "queue": True,
        "loads": [batch, interactive],
        "duration": interactive_s,
        "probe": "interactive",
    }
    # B's "alone" and "beside A's flood" the same way (A's 64-deep queue drains in about 4 s).
    flood = {
        **next(load for load in plan["noisy_fair"]["loads"] if load["tenant"] == "a"),
        "on_s": 10.0,
        "off_s": 10.0,
        "settle_s": 5.0,
    }
    b = next(load for load in plan["noisy_fair"]["loads"] if load["tenant"] == "b")
    plan["noisy_switching"] = {"queue": True, "loads": [flood, b], "duration": interactive_s, "probe": "b"}
    return plan


def queue_settings(
    models: list[str], capacity: int, *, enabled: bool, batch_share: float, reserve_share: float | None = None
) -> dict[str, Any]:
    """The gateway's settings: the three default tiers with the module benchmark's bounds, a
    keep-alive longer than any wait (so a refusal is an HTTP status, never an SSE error), and
    room for the 'before' flood's connections."""
    tiers = [
        {"name": "interactive", "queue_timeout_s": 120},
        {"name": "standard", "max_queue_length": 64, "queue_timeout_s": 120},
        {"name": "batch", "max_queue_length": 64, "queue_timeout_s": 120, "capacity_share": batch_share},
    ]
    return {
        "models": models,
        "max_connections": 4000,
        "request_timeout_s": 600,
        "upstream_idle_timeout_s": 300,
        "queue": {
            "enabled": enabled,
            "tiers": tiers,
            "keepalive_s": 600,
            **({} if reserve_share is None else {"reserve_share": reserve_share}),
        },
        "model_queues": {m: {"max_ongoing_requests": capacity, "cold_start_timeout_s": 300} for m in models},
    }


def make_keys(redis_url: str, tenants: list[str]) -> dict[str, str]:
    from serving.gateway.auth.keys import RedisKeyStore

    async def create() -> dict[str, str]:
        store = RedisKeyStore(redis_url)
        keys = {}
        try:
            for tenant in tenants:
                key, _ = await store.create(tenant, "bench", limits=GENEROUS, tier=TIERS.get(tenant))
                keys[tenant] = key
        finally:
            await store.aclose()
        return keys

    return asyncio.run(create())


# --- load: one process is one client of one gateway of the pair ------------------------------------


def load_process(scenario: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return asyncio.run(_load(scenario, index))


def _jobs(job: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """One (scenario with one load, gateway index) per process."""
    return [({**job, "loads": [load], "all_loads": job["loads"]}, i) for load in job["loads"] for i in range(PROCESSES)]


def phase(t: float, load: dict[str, Any]) -> str:
    """Where `t` (s since the start) falls in a load that switches on and off: 'on', 'off', or
    'settling' (its first `settle_s`, while the queue fills or drains)."""
    if "on_s" not in load:
        return "on"
    at = t % (load["on_s"] + load["off_s"])
    state, since = ("on", at) if at < load["on_s"] else ("off", at - load["on_s"])
    return "settling" if since < load["settle_s"] else state


# Complex on purpose: a benchmark client's loop: send, classify each outcome, record.
async def _load(scenario: dict[str, Any], index: int) -> list[dict[str, Any]]:  # noqa: C901
    import httpx

    records: list[dict[str, Any]] = []
    client = httpx.AsyncClient(
        base_url=scenario["gateways"][index],
        timeout=600,
        limits=httpx.Limits(max_connections=4000, max_keepalive_connections=400),
    )
    # Every process counts from the same wall-clock start, so phases line up across them.
    start = scenario["t0"]
    stop_at = start + scenario["duration"]
    await asyncio.sleep(max(0.0, start - time.time()))
    body = {
        "model": scenario["model"],
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "hi"}],
    }
    switching = next((load for load in scenario.get("all_loads", []) if "on_s" in load), None)

    async def one(tenant: str) -> None:
        sent = time.time()
        record: dict[str, Any] = {"tenant": tenant, "sent": sent - start}
        if switching is not None:
            record["phase"] = phase(sent - start, switching)
        headers = {"authorization": f"Bearer {scenario['keys'][tenant]}"}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                record["status"] = response.status_code
                record["wait"] = int(response.headers.get("x-queue-wait-ms", "-1")) / 1000
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and "ttft" not in record:
                        record["ttft"] = time.time() - sent
                        first = json.loads(line[6:])
                        if "error" in first:  # refused after the stream opened (never with this keep-alive)
                            record["status"] = first["error"].get("status", 0)
                        elif "arrived" in first:  # the upstream's clock: where the time went
                            record["to_upstream"] = first["arrived"] - sent
                            record["relay"] = sent + record["ttft"] - first["first_at"]
        except httpx.HTTPError as exc:
            record["status"], record["error"] = 0, type(exc).__name__
        record["done"] = time.time() - start
        records.append(record)

    def off(load: dict[str, Any], now: float) -> bool:
        return "on_s" in load and (now - start) % (load["on_s"] + load["off_s"]) >= load["on_s"]

    async def open_loop(load: dict[str, Any], rate: float) -> None:
        rng, pending = random.Random(f"{load['tenant']}{index}"), []
        while True:
            await asyncio.sleep(rng.expovariate(rate))
            if (now := time.time()) >= stop_at:
                break
            if not off(load, now):
                pending.append(asyncio.create_task(one(load["tenant"])))
        await asyncio.gather(*pending)

    async def closed_loop(load: dict[str, Any], outstanding: int) -> None:
        async def caller() -> None:
            while (now := time.time()) < stop_at:
                if off(load, now):
                    await asyncio.sleep(0.05)  # off: send nothing
                    continue
                await one(load["tenant"])

        await asyncio.gather(*(caller() for _ in range(outstanding)))

    share = 1 / PROCESSES
    jobs = [
        open_loop(load, load["rate"] * share)
        if load["kind"] == "open"
        else closed_loop(load, max(1, round(load["outstanding"] * share)))
        for load in scenario["loads"]
    ]
    try:
        await asyncio.gather(*jobs)
    finally:
        await client.aclose()
    return records


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds used so far by each role's processes."""
    import psutil

    return {role: sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in group) for role, group in pids.items()}


# --- figures ---------------------------------------------------------------------------------------


def summarize(
    records: list[dict[str, Any]], tenants: list[str], window: tuple[float, float], probe: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    groups = [(t, lambda r, t=t: r["tenant"] == t) for t in tenants]
    if probe is not None:  # a switching scenario: the probe beside the other load, and alone
        groups += [
            (
                f"{probe}_{state}",
                lambda r, state=state: (
                    r["tenant"] == probe and r.get("phase") == {"loaded": "on", "alone": "off"}[state]
                ),
            )
            for state in ("loaded", "alone")
        ]
    for tenant, mine_ in groups:
        mine = [r for r in records if mine_(r)]
        ok = served(mine)
        waits = [r["wait"] for r in ok if r.get("wait", -1) >= 0]  # the gateway's own figure: 0 when not queued
        out[tenant] = {
            **summary_of(mine, window),
            "to_upstream_p99_s": percentile([r["to_upstream"] for r in ok if "to_upstream" in r], 99),
            "relay_p99_s": percentile([r["relay"] for r in ok if "relay" in r], 99),
            "queued_share": sum(w > 0 for w in waits) / len(waits) if waits else None,
        }
    return out


def figures(s: dict[str, Any], capacity: int, service_s: float, duration: float) -> dict[str, Any]:
    def p99(scenario: str, tenant: str) -> float:
        return s[scenario]["tenants"][tenant]["ttft_p99_s"] or float("nan")

    window_s = duration - duration / 5
    full = capacity / service_s * window_s
    jain = [s["jain"]["tenants"][f"t{i}"]["served_in_window"] for i in range(4)]
    queued = {k: v for k, v in s.items() if k != "noisy_fcfs"}

    def ratio(scenario: str, probe: str, q: str) -> float:
        tenants = s[scenario]["tenants"]
        return round((tenants[f"{probe}_loaded"][q] or math.nan) / (tenants[f"{probe}_alone"][q] or math.nan), 2)

    return {
        "b_p99_ratio_beside_flood_vs_alone_interleaved": ratio("noisy_switching", "b", "ttft_p99_s"),
        "b_p50_ratio_beside_flood_vs_alone_interleaved": ratio("noisy_switching", "b", "ttft_p50_s"),
        "b_p99_ratio_fair_vs_alone": round(p99("noisy_fair", "b") / p99("b_alone", "b"), 2),
        "b_p99_ratio_fcfs_vs_alone": round(p99("noisy_fcfs", "b") / p99("b_alone", "b"), 2),
        "noisy_fair_5xx": sum(t["status_5xx"] for t in s["noisy_fair"]["tenants"].values()),
        "a_share_of_capacity_fair": round(s["noisy_fair"]["tenants"]["a"]["served_in_window"] / full, 3),
        "jain_index": round(jain_index(jain), 4),
        "interactive_p99_ratio_vs_alone": ratio("interactive", "interactive", "ttft_p99_s"),
        "interactive_p50_ratio_vs_alone": ratio("interactive", "interactive", "ttft_p50_s"),
        "interactive_queued_share_loaded": s["interactive"]["tenants"]["interactive_loaded"]["queued_share"],
        "upstream_peak_max_with_queue": max(v["upstream"]["peak"] for v in queued.values()),
        "upstream_fifo_waited_with_queue": sum(v["upstream"]["fifo_waited"] for v in queued.values()),
    }


def run(
    duration: float,
    capacity: int,
    service_s: float,
    out: Path,
    only: list[str] | None = None,
    *,
    interactive_s: float = 240,
    batch_share: float = 0.75,
    spread: float = 0.0,
    reserve_share: float | None = None,
) -> dict[str, Any]:
    import httpx

    from ops.devstack.local_redis import start_redis
    from ops.harness.processes import background, free_port, wait_for_http

    plan = {
        name: scenario
        for name, scenario in scenarios(capacity, service_s, interactive_s).items()
        if not only or name in only
    }
    models = {name: f"fq-{name}".replace("_", "-") for name in plan}
    results: dict[str, Any] = {
        "duration_s": duration,
        "capacity": capacity,
        "service_s": service_s,
        "interactive_duration_s": interactive_s,
        "batch_capacity_share": batch_share,
        "service_spread": spread,
        "reserve_share": reserve_share,
        "processes": PROCESSES,
        "gateways_per_mode": PROCESSES,
        "scenarios": {},
    }
    logs = Path(tempfile.mkdtemp(prefix="llmstack-fq-gateway-bench-"))
    with ExitStack() as stack:
        redis_server = start_redis()
        stack.callback(redis_server.stop)
        port = free_port()
        upstream = stack.enter_context(
            background(
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
                    "--spread",
                    str(spread),
                ],
                logs / "upstream.log",
            )
        )
        base = f"http://127.0.0.1:{port}"
        wait_for_http(f"{base}/stats", upstream, timeout_s=60)
        gateways: dict[str, list[str]] = {"fair": [], "fcfs": []}
        pids = {"upstream": [upstream.pid], "fair": [], "fcfs": []}
        for mode in gateways:
            for i in range(PROCESSES):
                api = free_port()
                env = {
                    "LLMSTACK_UPSTREAM_URL": base,
                    "LLMSTACK_REDIS_URL": redis_server.url,
                    "LLMSTACK_GATEWAY_PORT": str(api),
                    "LLMSTACK_GATEWAY_METRICS_PORT": str(free_port()),
                    "LLMSTACK_GATEWAY_SETTINGS": json.dumps(
                        queue_settings(
                            list(models.values()),
                            capacity,
                            enabled=mode == "fair",
                            batch_share=batch_share,
                            reserve_share=reserve_share,
                        )
                    ),
                }
                process = stack.enter_context(
                    background([sys.executable, "-m", "serving.gateway"], logs / f"gateway-{mode}-{i}.log", env)
                )
                wait_for_http(f"http://127.0.0.1:{api}/healthz", process, timeout_s=60)
                gateways[mode].append(f"http://127.0.0.1:{api}")
                pids[mode].append(process.pid)
        tenants = sorted({load["tenant"] for scenario in plan.values() for load in scenario["loads"]})
        keys = make_keys(redis_server.url, tenants)
        workers = PROCESSES * max(len(scenario["loads"]) for scenario in plan.values())
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            for name, scenario in plan.items():
                httpx.post(f"{base}/stats")
                load_before, cpu_before = os.getloadavg(), cpu_seconds(pids)
                seconds = scenario.get("duration", duration)
                job = {
                    **scenario,
                    "gateways": gateways["fair" if scenario["queue"] else "fcfs"],
                    "keys": keys,
                    "duration": seconds,
                    "model": models[name],
                    "t0": time.time() + 3,
                }
                parts = _jobs(job)
                records = [r for part in pool.map(load_process, *zip(*parts)) for r in part]
                upstream_stats = httpx.get(f"{base}/stats").json()
                cpu = {role: round(used - cpu_before[role], 1) for role, used in cpu_seconds(pids).items()}
                names = sorted({load["tenant"] for load in scenario["loads"]})
                summary = summarize(
                    records,
                    names,
                    (seconds / 5, seconds),  # skip the fill, and the drain
                    scenario.get("probe"),
                )
                results["scenarios"][name] = {
                    "tenants": summary,
                    "upstream": upstream_stats,
                    "cpu_s": cpu,
                    "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                }
                print(
                    f"{name}: upstream peak {upstream_stats['peak']}/{capacity} "
                    f"fifo-waited {upstream_stats['fifo_waited']}; load {load_before[0]:.1f}; cpu s {cpu}; "
                    + "; ".join(
                        f"{t} ok {v['ok']}/{v['sent']} 429 {v['status_429']} 5xx {v['status_5xx']} "
                        f"ttft p50 {v['ttft_p50_s'] or 0:.3f}s p99 {v['ttft_p99_s'] or 0:.3f}s "
                        f"(wait p99 {v['queue_wait_p99_s'] or 0:.3f}s, queued {v['queued_share'] or 0:.0%}, "
                        f"to upstream p99 {v['to_upstream_p99_s'] or 0:.3f}s, "
                        f"relay p99 {v['relay_p99_s'] or 0:.3f}s)"
                        for t, v in summary.items()
                    ),
                    flush=True,
                )
    if not only:
        results["figures"] = figures(results["scenarios"], capacity, service_s, duration)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--service-ms", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("build/bench/fair_queue_gateway.json"))
    parser.add_argument(
        "--interactive-duration",
        type=float,
        default=240,
        help="seconds of the interactive scenario (half of it counts: alone and loaded)",
    )
    parser.add_argument("--batch-share", type=float, default=0.75, help="the batch tier's capacity_share")
    parser.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="each answer's decode time within +-this fraction of the mean (0: all the same)",
    )
    # The stack default (0.1) rounds down to no slot at capacity 8; 2 slots cover B's peak
    # concurrency here (10% of capacity in Poisson arrivals), as README's sizing rule says.
    parser.add_argument("--reserve-share", type=float, default=0.25, help="gateway.queue.reserve_share")
    parser.add_argument("--only", type=lambda text: text.split(","), help="scenarios to run (no figures)")
    args = parser.parse_args(argv)
    started = time.time()
    results = run(
        args.duration,
        args.capacity,
        args.service_ms / 1000,
        args.out,
        args.only,
        interactive_s=args.interactive_duration,
        batch_share=args.batch_share,
        spread=args.spread,
        reserve_share=args.reserve_share,
    )
    print(json.dumps({**results.get("figures", {}), "seconds": round(time.time() - started)}, indent=2))


if __name__ == "__main__":
    main()
