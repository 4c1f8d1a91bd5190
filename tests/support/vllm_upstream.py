"""Parts for the gateway's billing and limit tests: a real uvicorn server in a thread, a vLLM-like
recording upstream, the gateway's access lines as they are logged, and Redis readers.

The upstream answers /v1/chat/completions and /v1/completions the way vLLM 0.32 does where
billing depends on it (vllm/entrypoints/openai/{chat_completion,completion}/serving.py): a
stream sends per-sequence usage in every chunk only when asked for `include_usage` and
`continuous_usage_stats`, a final usage chunk (no choices) only with `include_usage`; chunk
indexes are `prompt * n + sequence`; `n` sequences per prompt, several prompts on
/v1/completions. Requests steer it with a directive in their first prompt text, so the steering
survives any header or field filtering in the gateway:

    #stub {"id": "r1", "tokens": 6, "per_chunk": 2, "pause_after": 2}

- tokens: completion tokens per sequence (default 4), never more than the body's limit as vLLM
  reads it (chat: `max_completion_tokens`, else `max_tokens`; completions: `max_tokens`, else 16);
  per_chunk: tokens per chunk (several, as speculative decoding sends); pause_after: stop after
  this many content chunks and wait until the connection is closed (a stream cut at a known
  point; 0: after the headers); `body_pad`: bytes of padding text in a non-streamed answer (a
  large response);
- interval: generate like vLLM's engine, at its own pace: a step (per_chunk tokens for every
  sequence) every `interval` seconds, whether or not the response is being read, each step's
  events queued until sent (Ray Serve's streaming generator keeps pulling the engine's outputs
  and queues each as its own event), so a reader that stops lets the engine run ahead until the
  stream is closed; `event_pad`: about that many bytes of logprobs per token
  (what `top_logprobs` makes); `error_after`: the engine fails after this many steps: what it
  generated is sent, then an error event as vLLM streams one (internal text included) and
  `data: [DONE]`; `abort_delay`: seconds the
  engine runs on after the connection is closed (the cut reaching it through Ray Serve).

It records, per directive id, the usage it generated: prompt tokens once it has read the
prompt, each chunk's tokens before the chunk is sent. That is what "the upstream generated"
means in the billing tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.servers import serving

DIRECTIVE = "#stub "


def directive(**steer: Any) -> str:
    return DIRECTIVE + json.dumps(steer)


def _first_text(body: dict) -> str:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        content = messages[0].get("content")
        return content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def _steering(body: dict) -> dict:
    text = _first_text(body)
    if DIRECTIVE in text:
        return json.JSONDecoder().raw_decode(text.split(DIRECTIVE, 1)[1])[0]
    return {}


def engine_limit(body: dict, chat: bool) -> int | None:
    """The output limit per sequence as vLLM 0.32 reads the body (serving.gateway.metering.output_bound
    states the rule; its test checks it against vLLM). None: up to the context's end."""
    if chat:
        limit = body.get("max_completion_tokens")
        return limit if limit is not None else body.get("max_tokens")
    return body.get("max_tokens") if body.get("max_tokens") is not None else 16


def _prompts(body: dict) -> list[str]:
    if "messages" in body:
        return [json.dumps(body["messages"])]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt]
    return [prompt if isinstance(prompt, str) else ""]


def usage_event(chat: bool, model: str, prompt: int, completion: int) -> bytes:
    """The stream's last event before [DONE] when the client asked for usage, as vLLM sends it."""
    final = {
        "id": "x",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    return f"data: {json.dumps(final)}\n\n".encode()


class VllmLikeUpstream:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.generated: dict[str, dict[str, int]] = defaultdict(lambda: {"prompt": 0, "completion": 0})
        self.closed: set[str] = set()  # ids whose stream the gateway closed before its end
        self.stopped: set[str] = set()  # ids whose engine-paced generation has stopped
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        routes = [Route(path, self.complete, methods=["POST"]) for path in ("/v1/chat/completions", "/v1/completions")]
        routes.append(Route("/v1/models", self.models))
        return Starlette(routes=routes)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})

    def _count(self, rid: str, kind: str, tokens: int) -> None:
        with self._lock:
            self.generated[rid][kind] += tokens

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        chat = request.url.path == "/v1/chat/completions"
        steer = _steering(body)
        rid = str(steer.get("id", len(self.bodies)))
        tokens, per_chunk = int(steer.get("tokens", 4)), int(steer.get("per_chunk", 1))
        limit = engine_limit(body, chat)
        tokens = tokens if limit is None else min(tokens, limit)
        pause_after = steer.get("pause_after")
        n = body.get("n") or 1
        prompt_tokens = [len(p.encode()) // 4 + 1 for p in _prompts(body)]  # well inside the gateway's bound
        sequences = [(p, j) for p in range(len(prompt_tokens)) for j in range(n)]
        self._count(rid, "prompt", sum(prompt_tokens))  # prefill is done before the first output
        model = body.get("model", "tiny")
        if not body.get("stream"):
            self._count(rid, "completion", tokens * len(sequences))
            if pause_after is not None:
                await self._wait_for_close(request, rid)
            usage = {
                "prompt_tokens": sum(prompt_tokens),
                "completion_tokens": tokens * len(sequences),
                "total_tokens": sum(prompt_tokens) + tokens * len(sequences),
            }
            text = " tok" * tokens + "x" * int(steer.get("body_pad", 0))
            choices = [
                {
                    "index": i,
                    "finish_reason": "length",
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                }
                for i in range(len(sequences))
            ]
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 0,
                    "model": model,
                    "choices": choices,
                    "usage": usage,
                }
            )
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage") is True
        continuous = include_usage and options.get("continuous_usage_stats") is True

        pad = int(steer.get("event_pad", 0))
        token_logprobs = {
            "token": " tok",
            "logprob": -0.5,
            "top_logprobs": [{"token": f" t{k}", "logprob": -1.25} for k in range(pad // 36)],
        }

        def event(index: int, delta_text: str | None, done: list[int], finish: str | None = None) -> bytes:
            p = index // n
            if chat:
                delta = {"role": "assistant", "content": ""} if delta_text is None else {"content": delta_text}
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta_text or "", "finish_reason": finish}
            if pad and delta_text:  # one entry per token the event carries, as vLLM sends them
                choice["logprobs"] = {"content": [token_logprobs] * delta_text.count(" tok")}
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
            }
            if continuous:
                chunk["usage"] = {
                    "prompt_tokens": prompt_tokens[p],
                    "completion_tokens": done[index],
                    "total_tokens": prompt_tokens[p] + done[index],
                }
            return f"data: {json.dumps(chunk)}\n\n".encode()

        async def events():
            done = [0] * len(sequences)
            sent = 0
            try:
                if pause_after == 0:
                    await asyncio.sleep(3600)
                if chat:
                    for i in range(len(sequences)):
                        yield event(i, None, done)
                while min(done) < tokens:
                    for i in range(len(sequences)):
                        step = min(per_chunk, tokens - done[i])
                        if step <= 0:
                            continue
                        self._count(rid, "completion", step)
                        done[i] += step
                        yield event(i, " tok" * step, done, "length" if done[i] == tokens else None)
                        sent += 1
                        if pause_after is not None and sent >= pause_after:
                            await asyncio.sleep(3600)  # until the gateway closes the connection
                if include_usage:
                    yield usage_event(chat, model, sum(prompt_tokens), sum(done))
                yield b"data: [DONE]\n\n"
            except BaseException:
                self.closed.add(rid)
                raise

        if "interval" in steer:
            stream = self._engine_paced(
                rid,
                chat,
                sequences,
                tokens,
                per_chunk,
                float(steer["interval"]),
                pause_after,
                steer.get("error_after"),
                event,
                include_usage,
                prompt_tokens,
                model,
                float(steer.get("abort_delay", 0)),
            )
            return StreamingResponse(stream, media_type="text/event-stream")
        return StreamingResponse(events(), media_type="text/event-stream")

    async def _engine_paced(
        self,
        rid: str,
        chat: bool,
        sequences: list,
        tokens: int,
        per_chunk: int,
        interval: float,
        pause_after: int | None,
        error_after: int | None,
        event: Any,
        include_usage: bool,
        prompt_tokens: list[int],
        model: str,
        abort_delay: float,
    ) -> Any:
        """A stream whose tokens an engine task generates at its own pace (module docstring)."""
        done = [0] * len(sequences)
        queued: list[bytes] = []  # events generated and not yet sent, in order
        failed: list[int] = []
        woken = asyncio.Event()

        async def engine() -> None:
            steps = 0
            try:
                while min(done) < tokens:
                    if pause_after is not None and steps >= pause_after:
                        await asyncio.sleep(3600)  # until the gateway closes the connection
                    for i in range(len(sequences)):
                        step = min(per_chunk, tokens - done[i])
                        if step > 0:
                            self._count(rid, "completion", step)
                            done[i] += step
                            queued.append(event(i, " tok" * step, done, "length" if done[i] == tokens else None))
                    steps += 1
                    woken.set()
                    if error_after is not None and steps >= error_after:
                        failed.append(steps)  # the engine failed: it generates nothing more
                        return
                    await asyncio.sleep(interval)
            finally:
                woken.set()  # the response sees the end
                self.stopped.add(rid)

        running = asyncio.create_task(engine())
        try:
            if chat:
                for i in range(len(sequences)):
                    yield event(i, None, done)
            while True:
                await woken.wait()
                woken.clear()
                while queued:
                    yield queued.pop(0)
                if failed:  # what was generated went out, then the error, as vLLM streams one
                    yield (
                        b'data: {"error": {"message": "Message: Engine failed, Internal exception: '
                        b'RayActorError at 10.0.3.7 Traceback /home/ray/anaconda3/x.py", '
                        b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
                    )
                    yield b"data: [DONE]\n\n"
                    return
                if running.done() and not queued:
                    break
            if include_usage:
                yield usage_event(chat, model, sum(prompt_tokens), sum(done))
            yield b"data: [DONE]\n\n"
        except BaseException:
            self.closed.add(rid)
            raise
        finally:
            # The engine hears of the cut later (Ray Serve's proxy, then the replica, then vLLM's abort).
            asyncio.get_running_loop().call_later(abort_delay, running.cancel)

    async def _wait_for_close(self, request: Request, rid: str) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.02)
        self.closed.add(rid)


class AccessLines(logging.Handler):
    """The gateway's access lines (JSON), as logged, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = json.loads(record.getMessage())
        except ValueError:
            return
        with self._lock2:
            self.lines.append(line)

    def of(self, key_id: str, event: str = "access") -> list[dict]:
        with self._lock2:
            return [line for line in self.lines if line.get("key_id") == key_id and line.get("event") == event]


def redis_day(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.time()[0]) // 86_400
    finally:
        client.close()


def daily_used(url: str, name: str) -> int:
    """Tokens a daily counter (a Redis hash of day and used) holds for today."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        day, used = client.hmget(name, ["day", "used"])
        today = int(client.time()[0]) // 86_400
        return int(used) if day is not None and int(day) == today and used is not None else 0
    finally:
        client.close()


def key_id_of(key: str) -> str:
    return key.removeprefix("sk-llm-").split("_", 1)[0]


def gateway_settings(upstream_url: str, redis_url: str | None, **overrides: Any) -> Any:
    from serving.gateway.config.settings import GatewaySettings

    values = {"models": ["tiny"], "upstream_idle_timeout_s": 30, **overrides}
    return GatewaySettings(upstream_url=upstream_url, redis_url=redis_url, **values)


class GatewayURL(str):
    """A gateway's API URL; `.metrics` is the URL of its metrics port (/metrics, /readyz)."""

    metrics: str


@contextmanager
def serving_apps(settings: Any, store: Any) -> Iterator[GatewayURL]:
    """The real gateway apps (create_apps: the API and the metrics port) under uvicorn."""
    from serving.gateway.http.app import create_apps

    apps = create_apps(settings, store)
    with serving(apps.api) as api, serving(apps.admin) as admin:
        url = GatewayURL(api)
        url.metrics = admin
        yield url


@contextmanager
def running_gateway(
    upstream_url: str, redis_url: str | None, key_store: Any = None, **overrides: Any
) -> Iterator[GatewayURL]:
    """The real gateway under uvicorn, on Redis keys unless a store is given."""
    from serving.gateway.auth.keys import RedisKeyStore

    store = key_store if key_store is not None else RedisKeyStore(redis_url)
    with serving_apps(gateway_settings(upstream_url, redis_url, **overrides), store) as url:
        yield url
