"""Streams that outlive their replica: greedy streams through a running `make dev` (with
`gateway.stream_resume` on), one model replica SIGKILLed while they are in flight, every stream
checked against the same request run without a kill.

    python -m ops.benchmarks.stream_resume [--streams 50] [--max-tokens 200] [--kill-after 20]
        [--model tiny-chat] [--out build/bench/stream_resume.json]

Needs a running `make dev` (found through its lock, as `llmctl` finds it) whose stack turns
`gateway.stream_resume` on, has logical CPUs for a second replica of `--model` (`--stack`,
the stack file it runs); with `latency_target.adaptive: false` on that model every stream is in
flight at once (its capacity law would keep most of them in the gateway's queue). The run
scales the model to two replicas live (`llmctl scale`), runs the streams once uninterrupted (the
reference answers), runs them again and SIGKILLs one replica's worker process (found among
`make dev`'s descendants by the title Ray gives it) once `--kill-share` of the streams (default
0.5) are in flight with `--kill-after` content chunks or more (0: while none has its first byte,
a kill during prefill), then puts the model's replica bounds back. Greedy decoding (temperature 0,
`ignore_eos`, so every answer is `--max-tokens` long) makes the reference exact.

Reported: cut streams (an error, or no end), answers byte-identical to their reference, usage
equal to the reference's (billed once: the whole answer's prompt and completion), the resumes
and failures the gateway counted, and the gap: client side, per stream, the pause between its
last chunk before the kill and its first after it (p50 over every stream, p99 and max); gateway
side, its `llmstack_gateway_stream_resume_gap_seconds` histogram (count, mean). Everything runs
on this machine's cores beside the engines: quote figures taken on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.replicas import established, replica_processes, tree_cpu_s
from ops.benchmarks.resume_metrics import counter_deltas, quantile, resume_counters


@dataclass
class StreamResult:
    """What one client read: the answer, when each content chunk came, the usage, how it ended."""

    index: int
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each content chunk
    chunk_ends: list[int] = field(default_factory=list)  # len(text) after each content chunk
    ids: set[str] = field(default_factory=set)
    roles: int = 0
    usage: tuple[int, int] | None = None  # (prompt, completion) of the final usage chunk
    finish_reason: str | None = None
    error: str | None = None

    @property
    def whole(self) -> bool:
        """Ended with a finish reason and its usage, without an error: the client saw an end."""
        return self.error is None and self.finish_reason is not None and self.usage is not None

    def gap_around(self, moment: float) -> float | None:
        """The pause between the last chunk before `moment` (or `moment`) and the first after it."""
        before = [t for t in self.chunk_times if t <= moment]
        after = [t for t in self.chunk_times if t > moment]
        if not after:
            return None
        return after[0] - (before[-1] if before else moment)

    def chars_before(self, moment: float) -> int:
        """Characters the client had read by `moment`: where a resume at that moment picks up."""
        ends = [end for t, end in zip(self.chunk_times, self.chunk_ends, strict=True) if t <= moment]
        return ends[-1] if ends else 0


def first_difference(text: str, reference: str) -> int | None:
    """The first character position where `text` and `reference` differ (None: equal)."""
    if text == reference:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b), min(len(text), len(reference))
    )


def stream_record(result: StreamResult, reference: StreamResult, kill_at: float | None) -> dict:
    """One stream's findings: how it ended, its usage against the reference's, and where its text
    first differs from the reference against where the kill left it (a difference before the
    resume point is not the resume's)."""
    return {
        "index": result.index,
        "whole": result.whole,
        "error": result.error,
        "finish_reason": result.finish_reason,
        "usage": result.usage,
        "reference_usage": reference.usage,
        "chars": len(result.text),
        "reference_chars": len(reference.text),
        "first_difference": first_difference(result.text, reference.text),
        "chars_at_kill": None if kill_at is None else result.chars_before(kill_at),
        "gap_s": None if kill_at is None else result.gap_around(kill_at),
        "ids": len(result.ids),
        "roles": result.roles,
    }


def prompt(index: int, padding: int = 0) -> str:
    """Stream `index`'s question; `padding` more words make its prefill longer (a kill during it)."""
    pad = " ".join(f"n{(index * 31 + j) % 97}" for j in range(padding))
    return f"Stream {index}: tell the story of the number {index * 7919 % 1000} and all its neighbours. {pad}".strip()


def one_stream(client: openai.OpenAI, model: str, max_tokens: int, result: StreamResult, padding: int = 0) -> None:
    """Stream one greedy chat answer of exactly `max_tokens` tokens into `result` as the chunks
    come (a watcher sees the progress); an error is recorded, never raised."""
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt(result.index, padding)}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            result.ids.add(chunk.id)
            if chunk.usage is not None:
                result.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                if choice.delta.role:
                    result.roles += 1
                if choice.delta.content:
                    result.text += choice.delta.content
                    result.chunk_times.append(time.monotonic())
                    result.chunk_ends.append(len(result.text))
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
    except (openai.OpenAIError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]


def run_streams(
    base_url: str,
    key: str,
    model: str,
    streams: int,
    max_tokens: int,
    *,
    padding: int = 0,
    when: Callable[[list[StreamResult]], bool] | None = None,
    then: Callable[[], None] | None = None,
) -> list[StreamResult]:
    """`streams` concurrent streams, one thread each; `then()` is called once, as soon as
    `when(results so far)` holds while they run (not at all if they all end first)."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    results = [StreamResult(i) for i in range(streams)]
    threads = [
        threading.Thread(target=one_stream, args=(client, model, max_tokens, r, padding), daemon=True) for r in results
    ]
    for thread in threads:
        thread.start()
    if when is not None and then is not None:
        while any(thread.is_alive() for thread in threads):
            if when(results):
                then()
                break
            time.sleep(0.002)
    for thread in threads:
        thread.join()
    return results


def kill_point_reached(results: list[StreamResult], chunks: int, share: float) -> bool:
    """At least `share` of the streams are in flight with `chunks` content chunks or more."""
    in_flight = (r for r in results if r.finish_reason is None and r.error is None)
    return sum(len(r.chunk_times) >= chunks for r in in_flight) >= share * len(results)


# CPU seconds a replica's tree spends beyond its idle rate once requests reach it (a prefill)
BUSY_CPU_S = 0.5


class ReplicaKiller:
    """SIGKILLs the replica of `model` that serves the most streams in flight: the one whose
    established connections grew the most since `__init__` (HAProxy opens one per request unless
    it reuses an idle one, so the CPU its process tree used breaks ties); Serve's router need not
    spread a run's streams evenly. Replicas are found among `root_pid`'s descendants by title."""

    def __init__(self, root_pid: int, model: str) -> None:
        self.replicas = replica_processes(root_pid, f"LLMServer:{model}")
        if len(self.replicas) < 2:
            raise RuntimeError(f"{len(self.replicas)} replica(s) of {model}: the kill needs a second to resume on")
        self._connections = {p.pid: established(p) for p in self.replicas}
        self._cpu = {p.pid: tree_cpu_s(p) for p in self.replicas}
        self.killed: dict = {}

    def _load(self, process: psutil.Process) -> tuple[int, float]:
        return established(process) - self._connections[process.pid], tree_cpu_s(process) - self._cpu[process.pid]

    def serving(self) -> bool:
        """Requests reached some replica: a connection more than at the start, or its engine busy."""
        return any(added > 0 or cpu > BUSY_CPU_S for added, cpu in map(self._load, self.replicas))

    def __call__(self) -> None:
        load = {p.pid: self._load(p) for p in self.replicas}
        victim = max(self.replicas, key=lambda p: load[p.pid])
        engines = [p.pid for p in victim.children(recursive=True)]
        os.kill(victim.pid, signal.SIGKILL)
        self.killed = {
            "at": time.monotonic(),
            "pid": victim.pid,
            "engine_pids": engines,
            "connections_and_cpu_s_since_start": {str(pid): [n, round(c, 2)] for pid, (n, c) in load.items()},
        }


class ScaleDown:
    """Instead of a kill: `llmctl scale` the model back to one replica while the streams run, in a
    thread of its own (it returns once Serve applied it). Serve stops one replica gracefully: its
    HAProxy drain (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S), then up to
    graceful_shutdown_timeout_s for its requests, then the kill; streams longer than that are cut
    by the kill and resumed by the gateway."""

    def __init__(self, stack: Path, model: str) -> None:
        self._stack, self._model = stack, model
        self.killed: dict = {}
        self.thread: threading.Thread | None = None

    def __call__(self) -> None:
        self.killed = {"at": time.monotonic(), "scale_down": "2 -> 1"}
        self.thread = threading.Thread(target=llmctl_scale, args=(self._stack, self._model, 1, 1), daemon=True)
        self.thread.start()


def compare(reference: list[StreamResult], killed: list[StreamResult], kill_at: float | None) -> dict:
    """The findings of a run with a kill against its uninterrupted reference."""
    cut = [r.index for r in killed if not r.whole]
    identical = [r.index for r, ref in zip(killed, reference, strict=True) if r.whole and r.text == ref.text]
    usage_equal = [r.index for r, ref in zip(killed, reference, strict=True) if r.usage == ref.usage]
    one_id = [r.index for r in killed if len(r.ids) == 1 and r.roles == 1]
    gaps = [] if kill_at is None else [g for r in killed if (g := r.gap_around(kill_at)) is not None]
    in_flight = [] if kill_at is None else [r.index for r in killed if r.chunk_times and r.chunk_times[-1] > kill_at]
    return {
        "streams": len(killed),
        "in_flight_at_kill": len(in_flight),
        "cut": len(cut),
        "cut_streams": cut,
        "errors": sorted({r.error for r in killed if r.error}),
        "byte_identical": len(identical),
        "different": [r.index for r in killed if r.whole and r.index not in identical],
        "usage_equal_to_reference": len(usage_equal),
        "one_id_one_role": len(one_id),
        "client_gap_s": {
            "p50": quantile(gaps, 0.5),
            "p99": quantile(gaps, 0.99),
            "max": max(gaps, default=None),
        },
        "per_stream": [stream_record(r, ref, kill_at) for r, ref in zip(killed, reference, strict=True)],
    }


def llmctl_scale(stack: Path, model: str, minimum: int, maximum: int, *, tries: int = 6) -> None:
    """`llmctl scale` on the running stack; tried again while Serve is still replacing a killed
    replica (the live apply refuses a deployment that is not healthy yet)."""
    command = [str(Path(sys.executable).parent / "llmctl"), "scale", "--stack", str(stack), "--model", model]
    command += ["--min", str(minimum), "--max", str(maximum)]
    for attempt in range(tries):
        result = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=900)
        if result.returncode == 0:
            return
        if attempt < tries - 1:
            time.sleep(20)
    raise RuntimeError(f"llmctl scale failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", type=Path, required=True, help="the stack file the running make dev runs")
    parser.add_argument("--model", default="tiny-chat")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--kill-after",
        type=int,
        default=20,
        help="content chunks every stream has at the kill; 0: while requests have reached a replica and no "
        "stream has a chunk yet (a kill during prefill)",
    )
    parser.add_argument(
        "--kill-share",
        type=float,
        default=0.5,
        help="share of the streams that must be in flight with --kill-after chunks (not all: on a quiet "
        "machine with two replicas at most ~30 of 50 had started at once, the first ending before the "
        "last began, so 0.9 never came)",
    )
    parser.add_argument("--padding", type=int, default=0, help="words added to each prompt (a longer prefill)")
    parser.add_argument(
        "--scale-down", action="store_true", help="scale the model from two replicas to one instead of a SIGKILL"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also run the streams a second time without a kill: how many answers differ from the reference "
        "with no resume at all (batching changes float sums, so greedy ties can flip), the floor for `different`",
    )
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "build/bench/stream_resume.json")
    args = parser.parse_args(argv)

    from ops.devstack.lock import find_running_dev
    from serving.gateway.auth.keys import create_key_sync

    dev = find_running_dev()
    if dev is None or dev.redis_url is None or dev.metrics_url is None:
        print("needs a running make dev with its redis-server", file=sys.stderr)
        return 2
    if not load_stack(args.stack).gateway.stream_resume.enabled:
        print(f"{args.stack}: gateway.stream_resume.enabled is not true", file=sys.stderr)
        return 2
    served = load_stack(args.stack).model(args.model)
    if served.latency_target.adaptive:
        # The capacity law may hold most of the streams in the gateway's queue (440-token streams put
        # the tiny model's ITL over its target), so few are in flight at once: lower --kill-share.
        print(
            f"{args.stack}: model {args.model} adapts its capacity (latency_target.adaptive); many streams may "
            "wait in the gateway's queue rather than be in flight at the kill",
            file=sys.stderr,
        )
    scaling = served.autoscaling
    limits = {"requests_per_minute": 100_000, "tokens_per_minute": 100_000_000, "max_concurrent_requests": 1000}
    key = create_key_sync(dev.redis_url, "bench-resume", "stream-resume", limits=limits)
    llmctl_scale(args.stack, args.model, 2, 2)
    try:
        reference = run_streams(dev.base_url, key, args.model, args.streams, args.max_tokens, padding=args.padding)
        control = (
            run_streams(dev.base_url, key, args.model, args.streams, args.max_tokens, padding=args.padding)
            if args.control
            else None
        )
        before = resume_counters(dev.metrics_url)
        killer: ReplicaKiller | ScaleDown = (
            ScaleDown(args.stack, args.model) if args.scale_down else ReplicaKiller(dev.pid, args.model)
        )

        def ready(results: list[StreamResult]) -> bool:
            if args.kill_after == 0:
                return not any(r.chunk_times for r in results) and (isinstance(killer, ScaleDown) or killer.serving())
            return kill_point_reached(results, args.kill_after, args.kill_share)

        killed = run_streams(
            dev.base_url,
            key,
            args.model,
            args.streams,
            args.max_tokens,
            padding=args.padding,
            when=ready,
            then=killer,
        )
        after = resume_counters(dev.metrics_url)
        if isinstance(killer, ScaleDown) and killer.thread is not None:
            killer.thread.join()
    finally:
        llmctl_scale(args.stack, args.model, scaling.min_replicas, scaling.max_replicas)
    report = {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "kill_after_chunks": args.kill_after,
        "padding_words": args.padding,
        "adaptive_capacity": served.latency_target.adaptive,
        "reference_whole": sum(r.whole for r in reference),
        "kill": killer.killed or "never: the streams ended before the kill point; lower --kill-after or --kill-share",
        "findings": compare(reference, killed, killer.killed.get("at")),
        "control_without_kill": None if control is None else compare(reference, control, None),
        "gateway": counter_deltas(before, after),
        "load_average": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    summary = {
        **report,
        **{
            part: {k: v for k, v in report[part].items() if k != "per_stream"}
            for part in ("findings", "control_without_kill")
            if report[part] is not None
        },
    }
    print(json.dumps(summary, indent=2, default=str))  # per stream: in the file
    return 0 if killer.killed else 1


if __name__ == "__main__":
    raise SystemExit(main())
