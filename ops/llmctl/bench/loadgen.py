"""The load generator behind `llmctl bench`: drives any OpenAI-compatible endpoint.

The caller is the official `openai` client (AsyncOpenAI), streaming with
`stream_options.include_usage`, so every figure is what an OpenAI SDK user would see:
TTFT is the first content chunk, the token counts are the server's own (usage chunk).
Two ways to load a server:
  concurrency  closed loop: N requests in flight, each worker sends the next when one ends
  rate         open loop: Poisson arrivals at R requests/s, however slowly the server answers
Each level stops after a request count or a duration (in-flight requests still finish).
Numbers are summarised by `ops.llmctl.bench.stats`; this module only measures.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Literal

import numpy as np
import openai
from pydantic import BaseModel, ConfigDict, Field

from ops.llmctl.bench.stats import LengthDistribution, RequestResult, error_type

# Plain words that most BPE vocabularies hold as single tokens, so `--prompt-tokens 64` asks
# for about 64 tokens on any model; the server's usage chunk reports the exact count.
WORDS = ("the of and to in is was for on that with as by at from his her an it are this be or "
         "which one had not but all were they she there been have their has would more time will "
         "when who new after first also two may some other into over up than its only most out "
         "made such these many then could year where so like what about between well people").split()


class LoadSpec(BaseModel):
    """What to send, where, and for how long (per level)."""

    model_config = ConfigDict(frozen=True)

    base_url: str = Field(description="OpenAI base URL, ending in /v1.")
    api_key: str = Field(default="EMPTY", description="Bearer key; servers without auth ignore it.")
    model: str = Field(description="Model name sent in every request.")
    api: Literal["chat", "completions"] = Field(default="chat", description="/chat/completions or /completions.")
    prompt_tokens: LengthDistribution = Field(description="Prompt length per request (approximate, in words).")
    output_tokens: LengthDistribution = Field(description="max_tokens per request.")
    requests: int | None = Field(default=None, ge=1, description="Requests per level; or use duration_s.")
    duration_s: float | None = Field(default=None, gt=0, description="Seconds of sending per level.")
    ignore_eos: bool = Field(default=True, description="vLLM extension: generate exactly max_tokens.")
    seed: int = Field(default=0, description="Seeds prompt words, lengths and arrival gaps.")
    timeout_s: float = Field(default=300, gt=0, description="Per-request timeout.")


def make_prompt(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def request_plan(spec: LoadSpec, rng: np.random.Generator):
    """Endless (prompt, max_tokens) pairs, drawn in batches from the seeded generator."""
    while True:
        lengths = zip(spec.prompt_tokens.sample(rng, 64), spec.output_tokens.sample(rng, 64))
        for prompt_len, output_len in lengths:
            yield make_prompt(rng, prompt_len), output_len


async def one_request(client: openai.AsyncOpenAI, spec: LoadSpec, prompt: str, max_tokens: int,
                      clock: Callable[[], float] = time.monotonic) -> RequestResult:
    """Send one streamed request and time its chunks. Never raises: a failure becomes an
    error type on the result, so a 429 from a gateway is counted, not fatal."""
    extra = {"ignore_eos": True} if spec.ignore_eos else None
    common = dict(model=spec.model, max_tokens=max_tokens, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    start = clock()
    chunk_times: list[float] = []
    usage = None
    try:
        if spec.api == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and _text(chunk, spec.api):
                chunk_times.append(clock())
    except Exception as exc:  # every failure is data: grouped by type in the summary
        return RequestResult(start=start, end=clock(), first_token=chunk_times[0] if chunk_times else None,
                             chunk_times=chunk_times, requested_output_tokens=max_tokens, error=error_type(exc),
                             error_message=str(exc).splitlines()[0] if str(exc) else "")
    end = clock()
    result = RequestResult(start=start, end=end, first_token=chunk_times[0] if chunk_times else None,
                           chunk_times=chunk_times, requested_output_tokens=max_tokens,
                           prompt_tokens=usage.prompt_tokens if usage else 0,
                           output_tokens=usage.completion_tokens if usage else len(chunk_times))
    if usage is None:  # include_usage was asked for: a stream without it ended early
        return result.model_copy(update={"error": "IncompleteStream",
                                         "error_message": "stream ended without its usage chunk"})
    if not chunk_times:
        return result.model_copy(update={"error": "NoOutput", "error_message": "stream carried no content"})
    return result


def _text(chunk, api: str) -> str | None:
    choice = chunk.choices[0]
    return choice.delta.content if api == "chat" else choice.text


def make_client(spec: LoadSpec) -> openai.AsyncOpenAI:
    # No retries: a retried request would hide the error and stretch its latency.
    return openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0, timeout=spec.timeout_s)


async def run_level(spec: LoadSpec, mode: Literal["concurrency", "rate"], level: float, *,
                    on_result: Callable[[RequestResult], None] | None = None,
                    stop: Callable[[], bool] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> list[RequestResult]:
    """Run one level to its request count or duration (or until `stop()` says so); returns
    every request's result. Seeded per level, so level 4 sends the same prompts every run."""
    rng = np.random.default_rng([spec.seed, int(level * 1000)])
    plan = request_plan(spec, rng)
    results: list[RequestResult] = []
    started = clock()
    sent = 0

    def may_send() -> bool:
        if stop is not None and stop():
            return False
        if spec.requests is not None and sent >= spec.requests:
            return False
        return spec.duration_s is None or clock() - started < spec.duration_s

    async def send(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> None:
        result = await one_request(client, spec, prompt, max_tokens, clock)
        results.append(result)
        if on_result is not None:
            on_result(result)

    async with make_client(spec) as client:
        if mode == "concurrency":
            async def worker() -> None:
                nonlocal sent
                while may_send():
                    sent += 1  # counted before the await: workers share one event loop
                    await send(client, *next(plan))

            await asyncio.gather(*(worker() for _ in range(int(level))))
        else:
            tasks = []
            while may_send():
                sent += 1
                tasks.append(asyncio.create_task(send(client, *next(plan))))
                await asyncio.sleep(float(rng.exponential(1.0 / level)))
            await asyncio.gather(*tasks)
    return results
