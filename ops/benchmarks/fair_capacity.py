"""Fairness where the contention is (issue 30, "Evidence"): on `make dev` (real Ray Serve, CPU vLLM,
the real gateway and its Redis), the adaptive capacity on and off in one run.

    python -m ops.benchmarks.fair_capacity [--phase-s 60] [--rounds 2] [--flood 48] \
        [--out build/bench/fair_capacity.json]
    python -m ops.benchmarks.fair_capacity --phase-s 15 --rounds 1 --flood 16   # a short check
    python -m ops.benchmarks.fair_capacity --ttft-ms 60   # a target near 2x B's TTFT alone
    python -m ops.benchmarks.fair_capacity --phases jain,growth --phase-s 30   # without the noisy phases
    python -m ops.benchmarks.fair_capacity --phases jain --jain-streams 96 --jain-tokens 128 --clients 2

It writes a stack file beside Pulumi.local.yaml's: the same tiny chat model twice, `tiny-chat`
with its latency target's adaptation on and `tiny-chat-fixed` with `adaptive: false` (capacity
always max_ongoing_requests, 64: the "off" of the same run), and the gateway's
`engine_priority` on (`--no-engine-priority` leaves it off). It starts that stack with
`python -m ops.devstack` (make dev's runner, its own state folder and ports), creates a key per
tenant in its Redis (standard tier; the weights below), and runs, each phase `--phase-s` long
(`--phases` picks which):

- `noisy`: per model, alternating adaptive and fixed (`--rounds` times): `b_alone` (tenant B sends
  one streamed request at a time) then `noisy` (tenant A keeps `--flood` streams in flight beside B).
  Reported: B's TTFT p50/p99 in each, the ratio noisy / alone, A's output tokens/s, and every
  request that failed (a status other than 200, an error event, a broken stream).
- `jain` (adaptive model): four tenants of weights 1, 1, 2, 4, each keeping `--jain-streams` (48)
  in flight (together three times the ceiling, so the fair queue decides), `--jain-tokens` (32)
  output tokens a request: Jain's index of output tokens/s per unit of weight (1: each got its
  weight's share), from the requests sent after the phase's first quarter (its ramp, where every
  stream's first request arrives at once and the slots go first come). The streams are sent from
  `--clients` processes (`ops.benchmarks.fair_load`; by default one per 8 streams, at most one per
  core), each with its share of every tenant's, so one process's CPU does not set the tenants'
  turnaround. Per tenant also where its requests' time went (the client's whole request, the
  gateway's part, the queue wait; `client_keeps_up` puts the client's mean beside the gateway's:
  far above 1x, the client is the bottleneck) and, sampled every 0.5 s from the queue's Redis
  hashes, the slots it held and its requests waiting: a tenant with none waiting cannot take its
  share, so a low figure for it is its clients' (and this machine's), not the queue's.
- `growth` (adaptive model): `--growth-streams` (64, the ceiling: all of any capacity in use, so
  the engine's TTFT follows the prompts; the law learns nothing while under half of it is used) on
  /v1/completions, whose prompts grow tenfold after one phase (about 40 to 400 tokens, within
  max_model_len 512 with the output) and shrink back after the next: every 0.5 s the capacity per
  replica the gateway allows (Redis, capacity.lua's hash) and the law's last move, and per 2 s the
  TTFT p90 of the requests sent in it, at the client and at the gateway, and their queue wait
  p90: the capacity trace, falling and recovering.

TTFT twice: the client's (from sending the request to its first content chunk) and the gateway's
(its access log's `ttft_ms` for the same `x-request-id`: from the request's arrival at the gateway's
app to its first content relayed). Both include the gateway's queue wait. They differ on this
2-core machine because the engine keeps both cores busy: a normal-priority process that wakes
waits for a core up to ~0.65 s (p99 ~0.23 s, measured with a 10 ms sleep loop during a 32-stream
flood; ~1 ms when idle, and none under SCHED_FIFO), so the client's p99 is mostly scheduler wait
on both the client and the gateway side, which a cluster (gateway pods off the GPU nodes) does not
have. The gateway's figure less its queue wait is what its capacity law steers by.

Requests ask for exact output lengths (`ignore_eos`, `max_tokens`). The client opens one
connection per request (`fair_load`: a reused keep-alive connection can be closed under it) and
retries nothing: a disconnect is a failed request. Afterwards it stops the stack
(SIGTERM to its runner, which stops Ray, the engines and Redis) and checks that none of the
processes it started is left.

Evidence, not a test: absolute figures are this machine's; the ratios within one run are the
result, and only on a quiet machine (load average under ~2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from infra.spec.stack_file import PROJECT_ROOT
from ops.benchmarks import fair_load
from ops.benchmarks.fair_load import CHAT_WORDS, OUTPUT_TOKENS, Load, Share, shares
from ops.harness.stub_gateway import GENEROUS

ADAPTIVE, FIXED = "tiny-chat", "tiny-chat-fixed"
WEIGHTS = {"w1a": 1.0, "w1b": 1.0, "w2": 2.0, "w4": 4.0}
# The growth phase's prompts, sent to /v1/completions (no chat template around them): "hello" is
# 4 tokens of the tiny model's tokenizer (a short run read 160 prompt tokens for 40 words), so
# about 40 and 400 tokens, 400 + 32 output within max_model_len 512. Each starts with its own number:
# vLLM's prefix cache (on in our serve config) reuses the KV of any prompt's leading blocks seen
# before, so identical prompts cost one prefill in all, and growing them moved no TTFT (runs 1 and 2).
SHORT_WORDS, LONG_WORDS = 10, 100
# Per tenant in the Jain phase. Above every tenant's weighted share of the ceiling (64: w4's share
# is 64 x 4/8 = 32), meant to keep a request of each tenant waiting when a slot frees. On this
# 2-core machine it does not for w4: a request spends about 1 s in the client and the edge for
# 0.5 s in its slot, so 48 streams keep about 16 slots busy (the log's run 3; `backlog` in the
# output says how often each tenant had nothing waiting). Kept at 48 to compare with runs 1 and 2;
# `--jain-streams 96` or more (the stack lifts the connection caps) keeps w4 backlogged.
JAIN_STREAMS = 48
# The growth phase's streams: the ceiling, so that whatever the capacity (35 per replica after the
# noisy phases of the quiet runs) it is all in use and the engine's TTFT follows the prompts' length
# (the law learns nothing while less than half of it is in flight: 16 streams never moved it); the
# excess waits in the gateway's queue.
GROWTH_STREAMS = 64
PHASES = ("noisy", "jain", "growth")


def stack_text(local_text: str, *, engine_priority: bool, ttft_ms: float | None = None) -> str:
    """Pulumi.local.yaml with its second model replaced by a copy of the first that does not adapt,
    both without LoRA adapters (ids are unique per stack, and fairness is measured on the base)."""
    document = yaml.safe_load(local_text)
    config = document["config"]
    served = next(m for m in config["llmstack:models"] if m["id"] == ADAPTIVE)
    adaptive = {key: value for key, value in served.items() if key != "lora"}
    if ttft_ms is not None:
        adaptive["latency_target"] = {**adaptive["latency_target"], "ttft_ms": ttft_ms}
    fixed = {**adaptive, "id": FIXED, "latency_target": {**adaptive["latency_target"], "adaptive": False}}
    config["llmstack:models"] = [adaptive, fixed]
    # Scheduling tokens, not cores: room for both models' replicas and their routers at once,
    # as the end-to-end stack gives itself (tests/support/devstack.py).
    for group in config["llmstack:node_groups"]:
        group["cpus_per_node"] = max(8, group.get("cpus_per_node", 0))
    gateway = config.setdefault("llmstack:gateway", {})
    gateway["queue"] = {**gateway.get("queue", {}), "engine_priority": engine_priority}
    # Room to wait for every stream of a long Jain phase (`--jain-streams 96`: 384 streams against a
    # capacity the law may cut to a few slots): past a tier's max_queue_length (256 for standard)
    # the tenant furthest ahead of its share is pushed out with a 429, which is the queue's rule
    # and not what this phase measures.
    if "tiers" not in gateway["queue"]:
        from serving.gateway.config.queue_policy import QueuePolicy

        tiers = [tier.model_dump() for tier in QueuePolicy().tiers]
        gateway["queue"]["tiers"] = [
            {**tier, "max_queue_length": max(tier["max_queue_length"], 1024)} for tier in tiers
        ]
    # Every tenant's streams come from this one address: the edge's per-address cap (64 by default,
    # what a real client gets) would refuse the Jain phase's 4 x 32 connections at connect.
    gateway["edge"] = {**gateway.get("edge", {}), "max_connections_per_client": 1024}
    # And the gateway's own cap (256, past which uvicorn answers a plain-text 503) would stop
    # `--jain-streams` above 60: enough streams for a heavy tenant to stay backlogged while each
    # request spends about a second in this machine's client and edge needs more (the log's run 3).
    gateway["max_connections"] = max(gateway.get("max_connections", 0), 1024)
    return yaml.safe_dump(document, sort_keys=False)


# --- the stack: make dev's runner in its own session -------------------------------------------------


class Stack:
    def __init__(self, stack_file: Path) -> None:
        from ops.harness.processes import free_port

        self.state_dir = tempfile.mkdtemp(prefix="llmstack-faircap-")
        env = {**os.environ, "LLMSTACK_STATE_DIR": self.state_dir}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.devstack", "--stack", str(stack_file), "--port", str(free_port())]
            + ["--ready-json"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr or ()), daemon=True).start()
        self.ready = self._wait_ready()
        from ops.devstack.lock import find_running_dev

        dev = find_running_dev(Path(self.state_dir))
        if dev is None or dev.redis_url is None:
            raise RuntimeError("make dev is ready but its lock file names no Redis")
        self.redis_url = dev.redis_url
        import psutil

        self.descendants = {p.pid for p in psutil.Process(self.process.pid).children(recursive=True)}

    def _wait_ready(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{") and '"ready"' in line:
                threading.Thread(target=lambda: [None for _ in self.process.stdout or ()], daemon=True).start()
                return json.loads(line)
        raise RuntimeError("ops.devstack exited before it was ready:\n" + "".join(self.stderr[-40:]))

    def stop(self) -> list[int]:
        """Stop the runner (it stops what it started); the pids still alive afterwards."""
        import psutil

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        left = []
        for pid in self.descendants:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        return left


async def make_keys(redis_url: str, tenants: dict[str, float]) -> dict[str, str]:
    """A key per tenant (standard tier, generous limits: only the queue decides), with its weight."""
    from serving.gateway.auth.keys import RedisKeyStore

    store = RedisKeyStore(redis_url)
    keys = {}
    try:
        for tenant, weight in tenants.items():
            key, _ = await store.create(tenant, "bench", limits=GENEROUS, weight=weight)
            keys[tenant] = key
    finally:
        await store.aclose()
    return keys


# --- figures ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all got the same, 1/n when one got everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return 0.0 if squares == 0 else total * total / (len(values) * squares)


def gateway_times(log_lines: list[str], field: str = "ttft_ms") -> dict[str, float]:
    """request id -> `field` in ms as the gateway's access log has it: `ttft_ms` from the request's
    arrival at the gateway's app to its first content relayed, its queue wait included;
    `latency_ms` to the response's end."""
    times = {}
    for line in log_lines:
        if '"event": "access"' not in line:
            continue
        entry = json.loads(line[line.index("{") :])
        if entry.get(field) is not None:
            times[entry["request_id"]] = float(entry[field])
    return times


def gateway_ttfts(log_lines: list[str]) -> dict[str, float]:
    return gateway_times(log_lines, "ttft_ms")


def mean(values: list[float]) -> float | None:
    return None if not values else sum(values) / len(values)


def summarize(
    records: list[dict[str, Any]],
    phase: str,
    tenant: str,
    seconds: float,
    gateway_ttft: dict[str, float] | None = None,
    gateway_latency: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One tenant in one phase. With `gateway_latency` (the access log's `latency_ms`) also where a
    request's time went: the client's whole request, the gateway's part of it (queue wait
    included), and the queue wait; client minus gateway is the time outside the gateway (client
    and edge, mostly waiting for a core on this machine)."""
    mine = [r for r in records if r["phase"] == phase and r["tenant"] == tenant]
    ok = [r for r in mine if r.get("status") == 200 and "error" not in r]
    ttfts = [r["ttft"] for r in ok if "ttft" in r]
    known = gateway_ttft or {}
    at_gateway = [known[r["request_id"]] for r in ok if r.get("request_id") in known]
    summary = {
        "requests": len(mine),
        "failed": len(mine) - len(ok),
        "ttft_p50_ms": None if not ttfts else round(1000 * (percentile(ttfts, 50) or 0)),
        "ttft_p99_ms": None if not ttfts else round(1000 * (percentile(ttfts, 99) or 0)),
        "gateway_ttft_p50_ms": None if not at_gateway else round(percentile(at_gateway, 50) or 0),
        "gateway_ttft_p99_ms": None if not at_gateway else round(percentile(at_gateway, 99) or 0),
        "output_tokens_per_s": round(sum(r.get("output_tokens", 0) for r in ok) / seconds, 1),
        "queue_wait_p50_ms": percentile([r.get("queue_wait_ms", 0) for r in ok], 50),
        "failures": dict(Counter(f"{r.get('status')} {r.get('error', '')}".strip() for r in mine if r not in ok)),
    }
    if gateway_latency is not None:
        timed = [r for r in ok if r.get("request_id") in gateway_latency and "done" in r]
        client = mean([1000 * (r["done"] - r["sent"]) for r in timed])
        gateway = mean([gateway_latency[r["request_id"]] for r in timed])
        wait = mean([float(r.get("queue_wait_ms", 0)) for r in timed])
        summary.update(
            {
                "client_latency_mean_ms": None if client is None else round(client),
                "gateway_latency_mean_ms": None if gateway is None else round(gateway),
                "queue_wait_mean_ms": None if wait is None else round(wait),
            }
        )
    return summary


async def capacity_trace(redis_url: str, model: str, until: float, out: list[dict[str, Any]], started: float) -> None:
    import redis.asyncio

    from serving.gateway.capacity.store import capacity_key
    from serving.gateway.queue.fair_queue import queue_keys

    loop = asyncio.get_running_loop()
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    keys = queue_keys(model, 3, adaptive=True)
    try:
        while loop.time() < until:
            slots, move = await client.hmget(capacity_key(model), "slots", "move")
            in_flight = await client.zcard(keys.inflight)
            out.append({"t": round(loop.time() - started, 2), "slots": slots, "move": move, "in_flight": in_flight})
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()


async def queue_trace(redis_url: str, model: str, until: float, out: list[dict[str, Any]], started: float) -> None:
    """Every 0.5 s, per tenant: the slots it holds and its requests waiting in the standard tier
    (fair_queue.lua's `holders` and `tenants` hashes): whether each tenant was backlogged at the
    gateway, which the weights need (a tenant with nothing waiting cannot take its share)."""
    import redis.asyncio

    from serving.gateway.queue.fair_queue import queue_keys

    loop = asyncio.get_running_loop()
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    keys = queue_keys(model, 3, adaptive=True)
    try:
        while loop.time() < until:
            holders = {str(t): int(n) for t, n in (await client.hgetall(keys.holders)).items()}
            tenants = await client.hgetall(keys.tenants)  # "<rank>|<tenant>" -> "<finish>|<queued>|<served>"
            waiting = {str(field).split("|", 1)[1]: int(str(value).split("|")[1]) for field, value in tenants.items()}
            out.append({"t": round(loop.time() - started, 2), "held": holders, "waiting": waiting})
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()


def backlog_summary(samples: list[dict[str, Any]], tenants: list[str]) -> dict[str, dict[str, float]]:
    """Per tenant over the samples: mean slots held, mean requests waiting, and the share of samples
    in which it had none waiting (then the queue could not give it a freed slot)."""
    if not samples:
        return {}
    n = len(samples)
    return {
        t: {
            "held_mean": round(sum(s["held"].get(t, 0) for s in samples) / n, 1),
            "waiting_mean": round(sum(s["waiting"].get(t, 0) for s in samples) / n, 1),
            "none_waiting": round(sum(1 for s in samples if not s["waiting"].get(t)) / n, 2),
        }
        for t in tenants
    }


async def run_phases(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    keys = await make_keys(stack.redis_url, {"a": 1.0, "b": 1.0, **WEIGHTS, "g": 1.0})
    load = Load(stack.ready["base_url"], keys)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: dict[str, Any] = {"noisy": [], "jain": None, "growth": None}
    try:
        for model in (ADAPTIVE, FIXED):  # warm both engines (first requests compile and allocate)
            await load.closed("b", model, "warmup", 2, loop.time() + 5, started)
        if "noisy" in args.phases:
            await noisy_phases(stack, load, args, started, results)
        if "jain" in args.phases:
            results["jain"] = await jain_phase(stack, load, args, started)
            print(json.dumps(results["jain"]), flush=True)
        if "growth" in args.phases:
            results["growth"] = await growth_phase(stack, load, args, started)
            print(json.dumps({k: v for k, v in results["growth"].items() if k != "capacity"}), flush=True)
    finally:
        await load.client.close()
    results["failed_total"] = sum(1 for r in load.records if r.get("status") != 200 or "error" in r)
    return results


async def noisy_phases(
    stack: Stack, load: Load, args: argparse.Namespace, started: float, results: dict[str, Any]
) -> None:
    loop, phase_s = asyncio.get_running_loop(), args.phase_s
    for round_ in range(args.rounds):
        for model in (ADAPTIVE, FIXED) if round_ % 2 == 0 else (FIXED, ADAPTIVE):
            alone, noisy = f"b_alone:{model}:{round_}", f"noisy:{model}:{round_}"
            await load.closed("b", model, alone, 1, loop.time() + phase_s, started)
            until = loop.time() + phase_s
            await asyncio.gather(
                load.closed("a", model, noisy, args.flood, until, started),
                load.closed("b", model, noisy, 1, until, started),
            )
            at_gateway = gateway_ttfts(stack.stderr)
            b_alone, b_noisy = (summarize(load.records, p, "b", phase_s, at_gateway) for p in (alone, noisy))
            a_noisy = summarize(load.records, noisy, "a", phase_s, at_gateway)
            results["noisy"].append(
                {
                    "model": model,
                    "adaptive": model == ADAPTIVE,
                    "round": round_,
                    "b_alone": b_alone,
                    "b_noisy": b_noisy,
                    "a_noisy": a_noisy,
                    "b_p99_ratio": None
                    if not (b_alone["ttft_p99_ms"] and b_noisy["ttft_p99_ms"])
                    else round(b_noisy["ttft_p99_ms"] / b_alone["ttft_p99_ms"], 2),
                    "b_gateway_p99_ratio": None
                    if not (b_alone["gateway_ttft_p99_ms"] and b_noisy["gateway_ttft_p99_ms"])
                    else round(b_noisy["gateway_ttft_p99_ms"] / b_alone["gateway_ttft_p99_ms"], 2),
                }
            )
            print(json.dumps(results["noisy"][-1]), flush=True)


# The Jain phase's first quarter is its ramp: every stream's first request arrives at once and the
# first slots go first come, first served; its figures are read from the rest.
RAMP_FRACTION = 0.25


def steady_records(records: list[dict[str, Any]], phase: str, start: float, end: float) -> list[dict[str, Any]]:
    """The requests of `phase` sent after its ramp and before `end` (times `started`-relative, as the
    records'), as phase `<phase>:steady`: a closed loop's requests sent in a stretch are what it
    was served in it, however long each took, and none of them got a slot of the ramp's
    first-come split (a request ending after the ramp may have been admitted in it: with seconds of
    latency, most of a short phase's would be)."""
    ramp_end = start + RAMP_FRACTION * (end - start)
    return [{**r, "phase": f"{phase}:steady"} for r in records if r["phase"] == phase and ramp_end <= r["sent"] < end]


async def jain_phase(stack: Stack, load: Load, args: argparse.Namespace, started: float) -> dict[str, Any]:
    """Four weighted tenants on the adaptive model, their streams sent from `--clients` processes
    (`fair_load.run_share`) while this one samples the queue; per tenant also where its requests'
    time went and whether it had requests waiting in the gateway's queue (queue_trace)."""
    from ops.llmctl.bench.workers import WorkerPool

    phase_s = args.phase_s
    jobs = [
        Share(
            base_url=load.base_url,
            keys={t: load.keys[t] for t in WEIGHTS},
            streams=part,
            model=ADAPTIVE,
            phase="jain",
            output_tokens=args.jain_tokens,
            started=started,
            seconds=phase_s,
        )
        for part in shares(dict.fromkeys(WEIGHTS, args.jain_streams), args.clients)
    ]
    samples: list[dict[str, Any]] = []
    async with WorkerPool(len(jobs), module=fair_load.__name__) as pool:
        start = await pool.start(jobs)
        until = start + phase_s
        parts, _ = await asyncio.gather(
            pool.results(dict[str, Any]), queue_trace(stack.redis_url, ADAPTIVE, until, samples, started)
        )
    load.records.extend(record for part in parts for record in part)
    at_gateway, latency = gateway_ttfts(stack.stderr), gateway_times(stack.stderr, "latency_ms")
    steady = steady_records(load.records, "jain", start - started, until - started)
    seconds = (1 - RAMP_FRACTION) * phase_s
    tenants = {t: summarize(steady, "jain:steady", t, seconds, at_gateway, latency) for t in WEIGHTS}
    per_weight = {t: tenants[t]["output_tokens_per_s"] / w for t, w in WEIGHTS.items()}
    return {
        "tokens_per_s_per_weight": per_weight,
        "jain_index": round(jain_index(list(per_weight.values())), 3),
        "client_keeps_up": client_keeps_up(tenants),
        "clients": len(jobs),
        "failed": sum(summarize(load.records, "jain", t, phase_s)["failed"] for t in WEIGHTS),
        "tenants": tenants,
        "backlog": backlog_summary(samples[int(len(samples) * RAMP_FRACTION) :], list(WEIGHTS)),
    }


def client_keeps_up(tenants: dict[str, dict[str, Any]]) -> dict[str, str | None]:
    """Per tenant, "client mean / gateway mean" latency of its requests and their ratio. Near 1 the
    client reads each response as the gateway sends it; well above 1 the requests waited outside
    the gateway (the client's processes or the edge, on this machine mostly for a core), and a
    tenant's tokens/s are then the client's turnaround rather than the queue's share."""
    out: dict[str, str | None] = {}
    for tenant, summary in tenants.items():
        client, gateway = summary.get("client_latency_mean_ms"), summary.get("gateway_latency_mean_ms")
        out[tenant] = None if not (client and gateway) else f"{client} / {gateway} ms ({client / gateway:.2f}x)"
    return out


GROWTH_STAGES = (("short", SHORT_WORDS), ("long", LONG_WORDS), ("short", SHORT_WORDS))


async def growth_phase(stack: Stack, load: Load, args: argparse.Namespace, started: float) -> dict[str, Any]:
    """`--growth-streams` streams on /v1/completions, each stage (GROWTH_STAGES) `--phase-s` long:
    prompts grow tenfold, then shrink back, so the trace can show the capacity fall and recover."""
    loop, phase_s = asyncio.get_running_loop(), args.phase_s
    trace: list[dict[str, Any]] = []
    load.completions = True
    growth_started = loop.time()
    until = growth_started + len(GROWTH_STAGES) * phase_s

    async def stages() -> None:
        for _, words in GROWTH_STAGES:
            load.words = words  # the requests sent from now on
            await asyncio.sleep(phase_s)

    await asyncio.gather(
        load.closed("g", ADAPTIVE, "growth", args.growth_streams, until, started),
        capacity_trace(stack.redis_url, ADAPTIVE, until, trace, started),
        stages(),
    )
    load.completions, load.words = False, CHAT_WORDS
    stage_names = [name for name, _ in GROWTH_STAGES]
    return growth_summary(
        load.records, trace, growth_started - started, phase_s, stage_names, gateway_ttfts(stack.stderr)
    )


def growth_summary(
    records: list[dict[str, Any]],
    trace: list[dict[str, Any]],
    start: float,
    phase_s: float,
    stages: list[str],
    gateway_ttft: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per 2 s from the growth phase's start: the capacity per replica and the law's last move
    (the last sample), the most in flight, and of the requests sent in it the TTFT p90 at the client
    and at the gateway (the access log's, queue wait included: what a user of the gateway sees)
    and the queue wait p90 (the gateway's TTFT minus it is the engine's, which the law steers by)."""
    growth = [r for r in records if r["phase"] == "growth"]
    known = gateway_ttft or {}

    def stage(offset: float) -> int:
        return min(len(stages) - 1, max(0, int(offset // phase_s)))

    rows = []
    for edge in range(0, int(len(stages) * phase_s), 2):
        low, high = start + edge, start + edge + 2
        sent = [r for r in growth if low <= r["sent"] < high and "ttft" in r]
        samples = [s for s in trace if low <= s["t"] < high]
        p90 = percentile([r["ttft"] for r in sent], 90)
        at_gateway = percentile([known[r["request_id"]] for r in sent if r.get("request_id") in known], 90)
        rows.append(
            {
                "t_s": edge,
                "prompt": stages[stage(edge)],
                "capacity": samples[-1]["slots"] if samples else None,
                "move": samples[-1].get("move") if samples else None,
                "in_flight_max": max((s.get("in_flight", 0) for s in samples), default=None),
                "ttft_p90_ms": None if p90 is None else round(1000 * p90),
                "gateway_ttft_p90_ms": None if at_gateway is None else round(at_gateway),
                "queue_wait_p90_ms": percentile([r.get("queue_wait_ms", 0) for r in sent], 90),
                "requests": len(sent),
            }
        )
    prompts: dict[int, list[float]] = {}
    for r in growth:
        if "prompt_tokens" in r:
            prompts.setdefault(stage(r["sent"] - start), []).append(r["prompt_tokens"])
    prompt_p50 = [percentile(prompts.get(i, []), 50) for i in range(len(stages))]
    return {
        "prompt_tokens_p50": prompt_p50,  # per stage
        "trace": rows,
        "capacity": trace,
        "failed": sum(1 for r in growth if r.get("status") != 200 or "error" in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flood", type=int, default=48, help="tenant A's streams in flight")
    parser.add_argument("--no-engine-priority", action="store_true")
    parser.add_argument("--phases", type=lambda text: text.split(","), default=list(PHASES), help="e.g. jain,growth")
    parser.add_argument("--jain-streams", type=int, default=JAIN_STREAMS, help="streams per tenant, Jain phase")
    parser.add_argument("--jain-tokens", type=int, default=OUTPUT_TOKENS, help="output tokens a request, Jain phase")
    parser.add_argument(
        "--clients",
        type=int,
        help="client processes sending the Jain phase's streams (default: one per 8 streams, at most one per core)",
    )
    parser.add_argument("--growth-streams", type=int, default=GROWTH_STREAMS, help="streams in flight, growth phase")
    parser.add_argument(
        "--ttft-ms", type=float, help="both models' latency_target.ttft_ms (default: Pulumi.local.yaml's, 300)"
    )
    parser.add_argument("--out", default="build/bench/fair_capacity.json")
    args = parser.parse_args()
    if args.clients is None:
        from ops.llmctl.bench.split import default_processes

        args.clients = default_processes("concurrency", [len(WEIGHTS) * args.jain_streams], os.cpu_count() or 1)
    # SIGTERM (a stopped job, a CI timeout) unwinds like Ctrl-C, so the `finally` stops the stack.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    folder = Path(tempfile.mkdtemp(prefix="llmstack-faircap-stack-"))
    stack_file = folder / "Pulumi.faircap.yaml"
    stack_file.write_text(
        stack_text(
            (PROJECT_ROOT / "Pulumi.local.yaml").read_text(),
            engine_priority=not args.no_engine_priority,
            ttft_ms=args.ttft_ms,
        )
    )
    load_average = os.getloadavg()[0]
    stack = Stack(stack_file)
    try:
        results = asyncio.run(run_phases(stack, args))
    finally:
        left = stack.stop()
    results.update(
        {
            "command": " ".join(sys.argv),
            "load_average_at_start": round(load_average, 2),
            "load_average_at_end": round(os.getloadavg()[0], 2),
            "processes_left": left,
            "devstack_log_tail": stack.stderr[-60:],  # make dev's own lines: an engine that died says so here
        }
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}; load average {load_average:.1f} at start; processes left: {left or 'none'}")


if __name__ == "__main__":
    main()
