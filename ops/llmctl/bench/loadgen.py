"""The load generator behind `llmctl bench`: drives any OpenAI-compatible endpoint.

The caller is the official `openai` client (AsyncOpenAI), streaming with
`stream_options.include_usage`, so every figure is what an OpenAI SDK user would see:
TTFT is the first content chunk, the token counts are the server's own (usage chunk).
Two ways to load a server:
  concurrency  closed loop: N requests in flight, each worker sends the next when one ends
  rate         open loop: Poisson arrivals at R requests/s, however slowly the server answers
Each level stops after a request count or a duration (in-flight requests still finish).
An open loop's arrivals are one seeded schedule (`schedule`), each sent at its own instant.
`run_level` runs a level, or one process's part of it (`ops.llmctl.bench.split`,
`ops.llmctl.bench.workers`: `llmctl bench` spreads a level over several processes).
Two workloads:
  single       every request is a new prompt
  multiturn    conversations: a system prompt shared by all of them, then `turns` user turns,
               each request carrying the whole conversation so far (the server's own answers
               included); what prefix caching and prefix-aware routing are for. A closed-loop
               worker holds one conversation at a time, so concurrency = conversations in flight.
Numbers are summarised by `ops.llmctl.bench.stats`; this module only measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import openai
from pydantic import BaseModel, ConfigDict, Field

from ops.llmctl.bench.stats import LengthDistribution, RequestResult, error_type

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

# Plain words that most BPE vocabularies hold as single tokens, so `--prompt-tokens 64` asks
# for about 64 tokens on any model; the server's usage chunk reports the exact count.
WORDS = (  # noqa: SIM905 - reads as prose
    "the of and to in is was for on that with as by at from his her an it are this be or "
    "which one had not but all were they she there been have their has would more time will "
    "when who new after first also two may some other into over up than its only most out "
    "made such these many then could year where so like what about between well people"
).split()


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
    workload: Literal["single", "multiturn"] = Field(default="single", description="See the module docstring.")
    turns: int = Field(default=4, ge=1, description="multiturn: user turns per conversation.")
    system_prompt_tokens: int = Field(default=256, ge=1, description="multiturn: shared system prompt, in words.")


def make_prompt(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def system_prompt(spec: LoadSpec) -> str:
    """The multiturn workload's system prompt: the same for every conversation of every level."""
    return make_prompt(np.random.default_rng([spec.seed, 7]), spec.system_prompt_tokens)


def request_plan(spec: LoadSpec, rng: np.random.Generator):
    """Endless (prompt, max_tokens) pairs, drawn in batches from the seeded generator."""
    while True:
        lengths = zip(spec.prompt_tokens.sample(rng, 64), spec.output_tokens.sample(rng, 64))
        for prompt_len, output_len in lengths:
            yield make_prompt(rng, prompt_len), output_len


async def one_request(
    client: openai.AsyncOpenAI,
    spec: LoadSpec,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    clock: Callable[[], float] = time.monotonic,
    text_out: list[str] | None = None,
) -> RequestResult:
    """Send one streamed request and time its chunks. Never raises: a failure becomes an
    error type on the result, so a 429 from a gateway is counted, not fatal. `prompt` is a
    string (a user message, or the completions prompt) or a whole chat conversation; the
    answer's text is appended to `text_out` chunk by chunk when given."""
    extra = {"ignore_eos": True} if spec.ignore_eos else None
    common: dict[str, Any] = dict(
        model=spec.model, max_tokens=max_tokens, stream_options={"include_usage": True}, extra_body=extra
    )
    start = clock()
    chunk_times: list[float] = []
    usage = None
    try:
        if spec.api == "chat":
            # The conversations we send are role/content dicts: what the SDK's message types describe.
            messages = cast(
                "list[ChatCompletionMessageParam]",
                prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
            )
            stream: AsyncIterator[Any] = await client.chat.completions.create(messages=messages, stream=True, **common)
        else:
            if isinstance(prompt, list):  # becomes this request's error, like any other failure
                raise ValueError("a chat conversation needs api chat")
            stream = await client.completions.create(prompt=prompt, stream=True, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            text = _text(chunk, spec.api) if chunk.choices else None
            if text:
                chunk_times.append(clock())
                if text_out is not None:
                    text_out.append(text)
    except Exception as exc:  # noqa: BLE001 - every failure is data: grouped by type in the summary
        return RequestResult(
            start=start,
            end=clock(),
            first_token=chunk_times[0] if chunk_times else None,
            chunk_times=chunk_times,
            requested_output_tokens=max_tokens,
            error=error_type(exc),
            error_message=str(exc).splitlines()[0] if str(exc) else "",
        )
    end = clock()
    result = RequestResult(
        start=start,
        end=end,
        first_token=chunk_times[0] if chunk_times else None,
        chunk_times=chunk_times,
        requested_output_tokens=max_tokens,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        output_tokens=usage.completion_tokens if usage else len(chunk_times),
        cached_tokens=_cached_tokens(usage),
    )
    if usage is None:  # include_usage was asked for: a stream without it ended early
        return result.model_copy(
            update={"error": "IncompleteStream", "error_message": "stream ended without its usage chunk"}
        )
    if not chunk_times:
        return result.model_copy(update={"error": "NoOutput", "error_message": "stream carried no content"})
    return result


def _cached_tokens(usage) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return cached if isinstance(cached, int) else None


def _text(chunk, api: str) -> str | None:
    choice = chunk.choices[0]
    return choice.delta.content if api == "chat" else choice.text


def make_client(spec: LoadSpec) -> openai.AsyncOpenAI:
    # No retries: a retried request would hide the error and stretch its latency.
    return openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0, timeout=spec.timeout_s)


class Arrival(BaseModel):
    """One open-loop request: when it is due, from the level's start, and what it asks."""

    model_config = ConfigDict(frozen=True)

    at_s: float = Field(ge=0, description="Seconds after the level's start.")
    prompt: str
    max_tokens: int = Field(ge=1)


class LevelPart(BaseModel):
    """What one process sends of a level (`ops.llmctl.bench.split` cuts a level into parts for
    worker processes); `whole_level` is all of it in one process."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(default=0, ge=0, description="Seeds the part's own prompts; 0 is the level's own stream.")
    concurrency: int = Field(default=0, ge=0, description="Closed loop: requests (or conversations) in flight.")
    requests: int | None = Field(
        default=None, ge=1, description="Closed loop: this part's requests; None: until the duration or stop()."
    )
    arrivals: list[Arrival] | None = Field(
        default=None, description="Open loop: this part's arrivals; None: the level's whole schedule, drawn as it goes."
    )


def whole_level(spec: LoadSpec, mode: Literal["concurrency", "rate"], level: float) -> LevelPart:
    return LevelPart(concurrency=int(level) if mode == "concurrency" else 0, requests=spec.requests)


def level_rng(spec: LoadSpec, level: float, part: int = 0) -> np.random.Generator:
    """Seeded per level (level 4 sends the same prompts every run) and per part."""
    return np.random.default_rng([spec.seed, int(level * 1000), *([part] if part else [])])


def schedule(spec: LoadSpec, rate: float) -> Iterator[Arrival]:
    """The open loop's arrivals at `rate` requests/s: Poisson (exponential gaps), seeded, cut at
    the spec's request count or duration (endless without either). Pure: the same spec gives
    the same arrivals, however many processes then send them."""
    rng = level_rng(spec, rate)
    plan = request_plan(spec, rng)
    at_s = 0.0
    for sent in itertools.count():
        if spec.requests is not None and sent >= spec.requests:
            return
        if spec.duration_s is not None and at_s >= spec.duration_s:
            return
        prompt, max_tokens = next(plan)
        yield Arrival(at_s=at_s, prompt=prompt, max_tokens=max_tokens)
        at_s += float(rng.exponential(1.0 / rate))


# Complex on purpose: both load modes (concurrency, rate) share one pacing loop.
async def run_level(  # noqa: C901
    spec: LoadSpec,
    mode: Literal["concurrency", "rate"],
    level: float,
    *,
    part: LevelPart | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    stop: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    client: openai.AsyncOpenAI | None = None,
    start_at: float | None = None,
) -> list[RequestResult]:
    """Run a level (or `part` of it) to its request count or duration, or until `stop()` says
    so; returns every request's result. `client`: an open client to send with (else one of
    its own); `start_at`: the `clock()` instant the level starts at, which its arrivals and
    duration count from (the parts of a level, in several processes, start together)."""
    part = part or whole_level(spec, mode, level)
    plan = request_plan(spec, level_rng(spec, level, part.index))
    results: list[RequestResult] = []
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - clock()))
    origin = clock() if start_at is None else start_at
    sent = 0

    def may_send() -> bool:
        if stop is not None and stop():
            return False
        if part.requests is not None and sent >= part.requests:
            return False
        return spec.duration_s is None or clock() - origin < spec.duration_s

    async def send(
        client: openai.AsyncOpenAI,
        prompt: str | list[dict[str, str]],
        max_tokens: int,
        text_out: list[str] | None = None,
    ) -> RequestResult:
        result = await one_request(client, spec, prompt, max_tokens, clock, text_out)
        results.append(result)
        if on_result is not None:
            on_result(result)
        return result

    async def conversation(client: openai.AsyncOpenAI) -> None:
        """One multiturn conversation; each turn counts as a request."""
        nonlocal sent
        messages = [{"role": "system", "content": system_prompt(spec)}]
        for _ in range(spec.turns):
            if not may_send():
                return
            sent += 1
            user, max_tokens = next(plan)
            messages.append({"role": "user", "content": user})
            answer: list[str] = []
            result = await send(client, list(messages), max_tokens, answer)
            if result.error is not None:
                return  # a conversation whose turn failed is over: its history is incomplete
            messages.append({"role": "assistant", "content": "".join(answer)})

    async with contextlib.AsyncExitStack() as owned:
        if client is None:
            client = await owned.enter_async_context(make_client(spec))
        if mode == "concurrency" and spec.workload == "multiturn":

            async def talker() -> None:
                while may_send():
                    await conversation(client)

            await asyncio.gather(*(talker() for _ in range(part.concurrency)))
        elif mode == "concurrency":

            async def worker() -> None:
                nonlocal sent
                while may_send():
                    sent += 1  # counted before the await: workers share one event loop
                    await send(client, *next(plan))

            await asyncio.gather(*(worker() for _ in range(part.concurrency)))
        else:
            tasks = []
            for arrival in part.arrivals if part.arrivals is not None else schedule(spec, level):
                # Each arrival waits for its own instant on the schedule, not a gap after the
                # previous send: a late wake-up then delays one request, not all that follow.
                await asyncio.sleep(max(0.0, origin + arrival.at_s - clock()))
                if stop is not None and stop():
                    break
                tasks.append(asyncio.create_task(send(client, arrival.prompt, arrival.max_tokens)))
            await asyncio.gather(*tasks)
    return results
