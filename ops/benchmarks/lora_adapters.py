"""LoRA adapters on a running model: cold-load time, and the throughput cost of mixing adapters.

    python -m ops.benchmarks.lora_adapters --url http://127.0.0.1:<serve port>/tiny-chat/v1 \\
        --model tiny-chat --adapters sql,pirate [--requests 64 --concurrency 8 --max-tokens 32] [--json]

1. Cold load: for each adapter, the first request that names it (the replica downloads it from
   S3 and vLLM loads it into a slot) against the next request to the same adapter (warm), both
   one output token, so the difference is the load. An adapter already loaded on the replica
   (a second run against the same stack) measures warm twice: restart the stack for cold figures.
2. Warm throughput per adapter mix: the same number of requests at the same concurrency, first
   to the base alone, then spread round-robin over the adapters, then over the base and the
   adapters; output tokens per second of each, and its ratio to the base alone's, measured in the
   same run.

Point `--url` at the model's own Serve application (what `make dev --ready-json` prints as
`model_urls`) to leave the gateway out, or at the gateway with `--api-key`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

PROMPT = [{"role": "user", "content": "Write a query that lists every customer and their orders."}]


async def _one(client: Any, model: str, max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of one chat completion."""
    started = time.perf_counter()
    answer = await client.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": max_tokens},
    )
    return time.perf_counter() - started, answer.usage.completion_tokens if answer.usage else 0


async def cold_loads(client: Any, model: str, adapters: list[str]) -> list[dict[str, Any]]:
    results = []
    for adapter in adapters:
        name = f"{model}:{adapter}"
        first, _ = await _one(client, name, 1)
        warm, _ = await _one(client, name, 1)
        results.append({"adapter": name, "first_s": round(first, 3), "warm_s": round(warm, 3)})
    return results


async def throughput(client: Any, names: list[str], requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Output tokens/s of `requests` requests spread round-robin over `names`."""
    queue = [names[i % len(names)] for i in range(requests)]
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            _, out = await _one(client, queue.pop(), max_tokens)
            tokens += out

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"models": names, "requests": requests, "output_tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    adapters = [a for a in args.adapters.split(",") if a]
    client = AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    await _one(client, args.model, 1)  # the base warm before anything is timed
    cold = await cold_loads(client, args.model, adapters)
    with_adapters = [f"{args.model}:{a}" for a in adapters]
    mixes = {"base": [args.model], "adapters": with_adapters, "base+adapters": [args.model, *with_adapters]}
    measured = {
        label: await throughput(client, names, args.requests, args.concurrency, args.max_tokens)
        for label, names in mixes.items()
    }
    base = measured["base"]["tokens_per_s"]
    for row in measured.values():
        row["vs_base"] = round(row["tokens_per_s"] / base, 3) if base else None
    await client.close()
    return {"cold_load": cold, "throughput": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="OpenAI base URL of the model (its Serve app, or the gateway)")
    parser.add_argument("--model", required=True, help="the base model's served name")
    parser.add_argument("--adapters", required=True, help="adapter ids, comma-separated")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for row in result["cold_load"]:
        print(f"{row['adapter']}: first request {row['first_s']:.3f} s, next {row['warm_s']:.3f} s")
    for label, row in result["throughput"].items():
        print(f"{label}: {row['tokens_per_s']:,.1f} output tok/s ({row['vs_base']}x the base alone)")


if __name__ == "__main__":
    main()
