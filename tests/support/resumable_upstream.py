"""A vLLM-like upstream whose replica can die mid-stream, and that answers continuations.

Streams as vLLM 0.32 does with `return_token_ids` and continuous usage: chat sends the prompt's
ids (`prompt_token_ids`) on its role chunk and each chunk's generated `token_ids`; completions
the prompt's ids on the first chunk's choice. Token `i` of an answer has id `FIRST_OUTPUT_ID + i`
and text ` t{i}`, so the whole answer to a request is known (`answer_text`), whoever generated
which part of it. A request steers it with a directive in its first prompt text:

    #stub {"id": "r1", "tokens": 8, "cut_after": 3, "cuts": 1, "interval": 0.01}

- tokens: output tokens of the whole answer (never more than the body's limit);
- cut_after: the replica dies after sending this many content chunks (its connection is
  aborted: no end of the chunked body, no [DONE]); `cuts`: how many streams of this answer die
  so (default 1: the first only); interval: seconds between tokens; resume_delay: seconds a
  continuation waits before its first token (the new replica's prefill of prompt and answer);
- engine_error: a dying stream ends instead with vLLM's error event for an engine stopped under
  it (500 `InternalServerError`, then `[DONE]`: a replica whose graceful shutdown ran out, an
  engine process killed while its replica lived); `error_code` sets the event's code (400: an
  error of the request, which is the answer and never resumed);
- in_prefill: a dying stream's replica dies before its response headers, as Ray Serve LLM's
  ingress sends them only with the first chunk: where the stream would have been, the page Ray's
  HAProxy serves for its 502 (`RAY_HAPROXY_502`).

A continuation (/v1/completions whose prompt is token ids: the prompt's, then the generated
ones) is answered deterministically from where those ids stop: the original request is known by
its prompt's first id (`request number`), the generated ids say how far it got. The upstream
records every request (`requests`: path and body) and what it generated (`generated[id]`: prompt
tokens read, output tokens generated, continuations included): "the upstream generated".
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.support.vllm_upstream import DIRECTIVE

FIRST_OUTPUT_ID = 100_000
PROMPT_TOKENS = 5


def answer_text(tokens: int) -> str:
    return "".join(f" t{i}" for i in range(tokens))


# What Ray Serve's HAProxy sends when the server it chose drops the request (its 502; 503 and 504
# alike): the page ray/serve/_private/haproxy.py writes and its config's `errorfile` lines serve.
RAY_HAPROXY_502 = (500, [(b"content-type", b"text/plain"), (b"content-length", b"21")], b"Internal Server Error")


class ReplicaDied(Exception):
    """Raised inside the response: uvicorn aborts the connection mid-body, as a killed replica's does."""


@dataclass
class _Answer:
    rid: str
    chat: bool
    model: str
    tokens: int
    cut_after: int | None
    cuts: int
    interval: float
    resume_delay: float = 0.0
    in_prefill: bool = False
    engine_error: bool = False
    error_code: int = 500
    streams: int = 0


@dataclass
class ResumableUpstream:
    url: str = ""
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    generated: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: {"prompt": 0, "completion": 0})
    )
    _answers: list[_Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def requests_of(self, rid: str) -> int:
        """The request number of the answer `rid`: the first id of its prompt, and of its continuations'."""
        return next(number for number, answer in enumerate(self._answers) if answer.rid == rid)

    def continuations(self) -> list[dict[str, Any]]:
        return [body for _, body in self.requests if isinstance(body.get("prompt"), list)]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                if (await receive())["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        document = json.loads(body)
        path = scope["path"]
        self.requests.append((path, document))
        answer, done, prompt_ids = self._answer_for(path, document)
        limit = document.get("max_completion_tokens") or document.get("max_tokens") or 16
        end = min(answer.tokens, done + limit)
        with self._lock:
            self.generated[answer.rid]["prompt"] += len(prompt_ids)
        answer.streams += 1
        dies = answer.cut_after is not None and answer.streams <= answer.cuts
        chat = path == "/v1/chat/completions"
        if not document.get("stream") or (dies and answer.in_prefill):
            await self._whole(send, answer, chat, dies, done, end, len(prompt_ids))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})

        async def event(chunk: dict[str, Any]) -> None:
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
            )

        base = {
            "id": f"cmpl-{len(self.requests)}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1000 + len(self.requests),
            "model": answer.model,
        }

        def usage(completion: int) -> dict[str, int]:
            return {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            }

        if chat:
            await event(
                {
                    **base,
                    "prompt_token_ids": prompt_ids,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    "usage": usage(0),
                }
            )
        if done > 0:  # a continuation: its prefill comes first
            await asyncio.sleep(answer.resume_delay)
        for sent, i in enumerate(range(done, end)):
            if dies and sent == answer.cut_after:
                if not answer.engine_error:
                    raise ReplicaDied(answer.rid)
                kind = "InternalServerError" if answer.error_code >= 500 else "BadRequestError"
                message = "EngineCore encountered an issue" if answer.error_code >= 500 else "bad request"
                await event({"error": {"message": message, "type": kind, "param": None, "code": answer.error_code}})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                return
            await asyncio.sleep(answer.interval)
            with self._lock:
                self.generated[answer.rid]["completion"] += 1
            finish = "length" if i + 1 == end else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [FIRST_OUTPUT_ID + i]}
            if chat:
                choice["delta"] = {"content": f" t{i}"}
            else:
                choice["text"] = f" t{i}"
                if sent == 0:
                    choice["prompt_token_ids"] = prompt_ids
            await event({**base, "choices": [choice], "usage": usage(i + 1 - done)})
        await event({**base, "choices": [], "usage": usage(end - done)})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _whole(
        self, send: Any, answer: _Answer, chat: bool, dies: bool, done: int, end: int, prompt: int
    ) -> None:
        """A non-streamed answer; one whose replica dies is HAProxy's page for a 502 instead (the
        engine had generated it, nobody got it)."""
        with self._lock:
            self.generated[answer.rid]["completion"] += end - done
        if dies:
            status, headers, page = RAY_HAPROXY_502
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": page})
            return
        text = "".join(f" t{i}" for i in range(done, end))
        choice = {
            "index": 0,
            "finish_reason": "length",
            **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
        }
        status, document = (
            200,
            {
                "id": "cmpl-whole",
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": answer.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": end - done,
                    "total_tokens": prompt + end - done,
                },
            },
        )
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": json.dumps(document).encode()})

    def _answer_for(self, path: str, document: dict[str, Any]) -> tuple[_Answer, int, list[int]]:
        """The answer a request belongs to, how many of its tokens the prompt holds already, and the prompt's ids."""
        prompt = document.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):  # a continuation
            answer = self._answers[prompt[0]]
            return answer, sum(1 for t in prompt if t >= FIRST_OUTPUT_ID), list(prompt)
        text = document["messages"][0]["content"] if "messages" in document else prompt
        steer = json.JSONDecoder().raw_decode(text.split(DIRECTIVE, 1)[1])[0]
        for number, known in enumerate(self._answers):
            if known.rid == str(steer["id"]):  # the same request sent again
                return known, 0, [number] + [1] * (PROMPT_TOKENS - 1)
        answer = _Answer(
            rid=str(steer["id"]),
            chat=path.endswith("chat/completions"),
            model=document.get("model", "tiny"),
            tokens=int(steer.get("tokens", 8)),
            cut_after=steer.get("cut_after"),
            cuts=int(steer.get("cuts", 1)),
            interval=float(steer.get("interval", 0.0)),
            resume_delay=float(steer.get("resume_delay", 0.0)),
            in_prefill=bool(steer.get("in_prefill", False)),
            engine_error=bool(steer.get("engine_error", False)),
            error_code=int(steer.get("error_code", 500)),
        )
        self._answers.append(answer)
        number = len(self._answers) - 1
        return answer, 0, [number] + [1] * (PROMPT_TOKENS - 1)
