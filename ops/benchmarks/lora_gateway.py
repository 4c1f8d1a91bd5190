"""What a LoRA adapter costs at the gateway: the same stub upstream reached through one gateway
for the base model and for an adapter on it, in one run, driven by `wrk`.

    python -m ops.benchmarks.lora_gateway [--duration 15] [--out build/bench/lora_gateway.json]

Three callers of one gateway (models ["tiny"], adapters {"tiny": ["sql"]}):
- `base`: the base model, a key with no adapter grants;
- `adapter_key_grant`: `tiny:sql` with a key holding its own grant (no Redis read more than `base`);
- `adapter_tenant_grant`: `tiny:sql` with a key that inherits its tenant's grant (one `GET` more:
  the tenant's grants are read on every such request, so a change holds at once).
For each: one client sending one request at a time (p50/p99, 1,000 requests, interleaved twice,
best run kept), the saturated rate with 100 connections (`wrk`), and the Redis commands per request
clients send (MONITOR, in a separate short run). The result is the ratio of each adapter caller to
`base` in the same run; absolute numbers are this machine's (wrk, the stub, Redis and the gateway
share its cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from ops.benchmarks.gateway import GENEROUS, RedisRoundTrips, one_at_a_time, parse_wrk
from ops.devstack.local_redis import start_redis
from ops.harness.stub_gateway import running_gateway, running_stub
from ops.harness.stub_upstream import CHAT_BODY
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import TenantStore

CONNECTIONS = 100
ADAPTER = "tiny:sql"


def wrk_once(url: str, key: str, model: str, duration_s: int, folder: Path) -> dict[str, float]:
    script = folder / f"wrk-{model.replace(':', '_')}-{key[-6:]}.lua"
    body = {**CHAT_BODY, "model": model}
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    command = ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{duration_s}s", "--timeout", "30s", "--latency", "-s", str(script)]
    output = subprocess.run([*command, f"{url}/v1/chat/completions"], capture_output=True, text=True, check=True)
    return parse_wrk(output.stdout)


def grant_tenant(redis_url: str, tenant: str, grants: list[str]) -> None:
    async def write() -> None:
        store = TenantStore(redis_url)
        try:
            await store.set_adapters(tenant, grants)
        finally:
            await store.aclose()

    asyncio.run(write())


def run(duration_s: int, sequential: int, out: Path) -> dict:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    folder = Path(tempfile.mkdtemp(prefix="llmstack-bench-lora-gateway-"))
    results: dict = {"connections": CONNECTIONS, "duration_s": duration_s, "callers": {}}
    with ExitStack() as stack:
        own_redis = start_redis()
        stack.callback(own_redis.stop)
        stub = stack.enter_context(running_stub(folder / "stub.log"))
        url = stack.enter_context(
            running_gateway(
                folder / "gateway.log",
                upstream=stub.url,
                redis_url=own_redis.url,
                settings={"models": ["tiny"], "model_adapters": {"tiny": ["sql"]}},
            )
        ).url
        grant_tenant(own_redis.url, "bench-tenant-grant", [ADAPTER])
        callers = {
            "base": (create_key_sync(own_redis.url, "bench", "base", limits=GENEROUS), "tiny"),
            "adapter_key_grant": (
                create_key_sync(own_redis.url, "bench", "own", limits=GENEROUS, allowed_adapters=[ADAPTER]),
                ADAPTER,
            ),
            "adapter_tenant_grant": (
                create_key_sync(own_redis.url, "bench-tenant-grant", "inherits", limits=GENEROUS),
                ADAPTER,
            ),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in callers}
        for _ in range(2):
            for name, (key, model) in callers.items():
                runs[name].append(one_at_a_time(url, key, sequential, model=model))
        for name, (key, model) in callers.items():
            print(f"==> {name}: warm-up, saturated, Redis commands", flush=True)
            wrk_once(url, key, model, 3, folder)
            saturated = wrk_once(url, key, model, duration_s, folder)
            with RedisRoundTrips(own_redis.url) as trips:
                counted = wrk_once(url, key, model, 3, folder)
            results["callers"][name] = {
                "one_at_a_time": min(runs[name], key=lambda r: r["p50_ms"]),
                "saturated": saturated,
                "redis_commands_per_request": round(trips.count / counted["requests"], 3)
                if counted["requests"]
                else None,
            }
            print(
                f"    one at a time p50 {results['callers'][name]['one_at_a_time']['p50_ms']:.2f} ms, "
                f"saturated {saturated['requests_per_s']:.0f} req/s (non-2xx {saturated['non_2xx']:.0f}), "
                f"Redis commands/request {results['callers'][name]['redis_commands_per_request']}",
                flush=True,
            )
    base = results["callers"]["base"]
    results["summary"] = {
        name: {
            "added_p50_ms_one_at_a_time": round(r["one_at_a_time"]["p50_ms"] - base["one_at_a_time"]["p50_ms"], 3),
            "saturated_over_base": round(
                r["saturated"]["requests_per_s"] / max(base["saturated"]["requests_per_s"], 1e-9), 3
            ),
            "redis_commands_per_request": r["redis_commands_per_request"],
        }
        for name, r in results["callers"].items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"], indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="Gateway cost of a LoRA adapter request vs its base model, with wrk.")
    parser.add_argument("--duration", type=int, default=15, help="seconds per saturated wrk run")
    parser.add_argument("--sequential", type=int, default=1000, help="requests per one-at-a-time run")
    parser.add_argument("--out", type=Path, default=Path("build/bench/lora_gateway.json"))
    args = parser.parse_args()
    run(args.duration, args.sequential, args.out)


if __name__ == "__main__":
    main()
