"""Gateway CPU per streamed output token: the stub upstream streams one SSE event per token,
as Ray Serve's direct streaming does, and the gateway relays (and meters) every event.

    python -m ops.benchmarks.gateway_stream [--tokens 64] [--connections 32] [--duration 10]
        [--rounds 2] [--interval-ms 0] [--gateway-src DIR ...] [--stream-resume-ab]
        [--out build/bench/gateway_stream.json]

One run starts redis-server and the stub (`ops.harness.stub_upstream`, which with the
`continuous_usage_stats` the gateway asks for sends the usage so far in every event, as vLLM
does), then one gateway process per `--gateway-src` (a checkout: its `serving.gateway` is the
one that runs; default this checkout), all on the same Redis and stub. `wrk` drives each
gateway in turn, `--rounds` times, alternating, with streamed chat completions of `--tokens`
tokens each from a client that did not ask for usage (so the gateway also strips the per-event
usage it asked for). With `--interval-ms 0` the stub sends a whole answer without a pause, so
one read of the upstream often holds many events; with a pause between events (an engine step,
as vLLM's direct streaming sends them) the gateway reads, meters and sends each event on its
own. Figure: CPU milliseconds of the gateway process (user + system, /proc) per output token
served. Everything shares this machine's cores: compare the checkouts within one run, not
across runs. `--stream-resume-ab` runs each checkout's gateway twice, with `gateway.stream_resume`
off and on (labels `<dir>` and `<dir> +stream_resume`): the resumable relay records every event
it relays (serving.gateway.resume.state) and asks the upstream for token ids, which the stub
ignores, so the difference is the gateway's own per-token cost of being able to resume.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import psutil

from infra.spec.stack_file import PROJECT_ROOT
from ops.benchmarks.gateway import GENEROUS, parse_wrk
from ops.devstack.local_redis import start_redis
from ops.harness.stub_gateway import running_gateway, running_stub
from serving.gateway.auth.keys import create_key_sync


def stream_body(tokens: int, interval_ms: int = 0) -> dict:
    steer = json.dumps({"chunks": tokens, **({"interval_ms": interval_ms} if interval_ms else {})})
    return {
        "model": "tiny",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": f"#stub {steer}"}],
    }


def wrk_script(key: str, tokens: int, interval_ms: int = 0) -> str:
    body = json.dumps(stream_body(tokens, interval_ms))
    return (
        "\n".join(
            [
                'wrk.method = "POST"',
                f"wrk.body = {json.dumps(body)}",
                'wrk.headers["Content-Type"] = "application/json"',
                f'wrk.headers["Authorization"] = "Bearer {key}"',
            ]
        )
        + "\n"
    )


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure(url: str, pid: int, script: Path, *, connections: int, duration_s: int, tokens: int) -> dict:
    command = [
        "wrk",
        "-t2",
        f"-c{connections}",
        f"-d{duration_s}s",
        "--timeout",
        "30s",
        "--latency",
        "-s",
        str(script),
        f"{url}/v1/chat/completions",
    ]
    before = cpu_s(pid)
    result = parse_wrk(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    used_ms = (cpu_s(pid) - before) * 1000
    served = result["requests"] - result["non_2xx"]
    result["cpu_ms_per_request"] = round(used_ms / max(served, 1), 3)
    result["cpu_ms_per_output_token"] = round(used_ms / max(served * tokens, 1), 4)
    result["output_tokens_per_s"] = round(result["requests_per_s"] * tokens, 1)
    return result


def run(
    sources: list[Path],
    *,
    tokens: int,
    connections: int,
    duration_s: int,
    rounds: int,
    out: Path,
    interval_ms: int = 0,
    stream_resume_ab: bool = False,
) -> dict:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    folder = Path(tempfile.mkdtemp(prefix="llmstack-bench-stream-"))
    results: dict = {
        "tokens": tokens,
        "connections": connections,
        "duration_s": duration_s,
        "interval_ms": interval_ms,
        "sources": [str(s) for s in sources],
        "stream_resume_ab": stream_resume_ab,
        "rounds": [],
    }
    with ExitStack() as stack:
        own_redis = start_redis()
        stack.callback(own_redis.stop)
        stub = stack.enter_context(running_stub(folder / "stub.log"))
        key = create_key_sync(own_redis.url, "bench", "bench-stream", limits=GENEROUS)
        script = folder / "stream.lua"
        script.write_text(wrk_script(key, tokens, interval_ms))
        gateways = []
        variants = [(False, ""), (True, " +stream_resume")] if stream_resume_ab else [(False, "")]
        for i, (source, (resume, suffix)) in enumerate((s, v) for s in sources for v in variants):
            settings: dict = {"models": ["tiny"]}
            if resume:
                settings["stream_resume"] = {"enabled": True}
            gateway = stack.enter_context(
                running_gateway(
                    folder / f"gateway-{i}.log",
                    upstream=stub.url,
                    redis_url=own_redis.url,
                    settings=settings,
                    cwd=source,
                )
            )
            gateways.append((str(source) + suffix, gateway.url, gateway.process.pid))
        for _, url, pid in gateways:  # warm pools and caches
            measure(url, pid, script, connections=connections, duration_s=2, tokens=tokens)
        for number in range(rounds):
            row = {}
            for label, url, pid in gateways:
                row[label] = measured = measure(
                    url, pid, script, connections=connections, duration_s=duration_s, tokens=tokens
                )
                print(
                    f"round {number + 1} {label}: {measured['cpu_ms_per_output_token']:.4f} CPU-ms/token, "
                    f"{measured['output_tokens_per_s']:.0f} tok/s, p50 {measured.get('p50_ms', 0):.1f} ms, "
                    f"non-2xx {measured['non_2xx']:.0f}, load {psutil.getloadavg()[0]:.2f}",
                    flush=True,
                )
            results["rounds"].append(row)
    results["cpu_ms_per_output_token"] = {
        source: [row[source]["cpu_ms_per_output_token"] for row in results["rounds"]] for source, _, _ in gateways
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["cpu_ms_per_output_token"], indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="Gateway CPU per streamed output token (one SSE event per token).")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens (SSE events) per answer")
    parser.add_argument("--connections", type=int, default=32, help="concurrent streams")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per gateway, alternating between them")
    parser.add_argument(
        "--interval-ms", type=int, default=0, help="the stub's pause between events (0: a whole answer in one write)"
    )
    parser.add_argument(
        "--gateway-src",
        type=Path,
        action="append",
        help="a checkout whose gateway to measure (repeatable; default: this checkout)",
    )
    parser.add_argument(
        "--stream-resume-ab",
        action="store_true",
        help="run each checkout's gateway with gateway.stream_resume off and on",
    )
    parser.add_argument("--out", type=Path, default=Path("build/bench/gateway_stream.json"))
    args = parser.parse_args()
    run(
        [p.resolve() for p in args.gateway_src or [PROJECT_ROOT]],
        tokens=args.tokens,
        connections=args.connections,
        duration_s=args.duration,
        rounds=args.rounds,
        out=args.out,
        interval_ms=args.interval_ms,
        stream_resume_ab=args.stream_resume_ab,
    )


if __name__ == "__main__":
    main()
