"""The relay's second half for a resumable stream: what follows once its upstream stream stopped
without its end marker (docs/gateway.md, "Resuming a stream").

`UpstreamStream` relays the first upstream stream as any other; when that stream breaks (a reset,
a body cut short, the idle timeout) or ends without `data: [DONE]`, it hands over to
`ResumingRelay.carry_on` (also when it ended with a server-side error event, held back from the
client: the engine stopped under it), which asks serving.gateway.resume.plan what follows and does it: sends
each continuation to the model's application (Ray Serve routes it to a live replica), splices its
events into the client's stream through the same meter, and ends the stream with the whole
answer's usage and `[DONE]`, or with an OpenAI error event and `[DONE]`: never a silent cut.

It runs inside the relay's task: a client that goes away cancels it like the relay (a client cut
is never resumed), the request's total deadline bounds it, and settlement stays the relay's, so
the key's tokens, its concurrency slot and the model's slot are held across a resume: limits and
the fair queue see one request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from starlette.types import Send
from yarl import URL

from serving.gateway.capacity.recorder import StreamTimer
from serving.gateway.metering.usage_meter import Usage, UsageMeter
from serving.gateway.resume.continuation import Continuation
from serving.gateway.resume.ending import StreamEnd, cut_of, replica_unavailable
from serving.gateway.resume.plan import Finish, GiveUp, Resume, Stop, after_upstream_end
from serving.gateway.resume.request import ResumableStream
from serving.gateway.resume.splice import Splice, final_usage_chunk
from serving.gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("llmstack.gateway.resume")

# POSTs one continuation body to a route path of the model's application.
Post = Callable[[str, dict[str, Any]], Awaitable[aiohttp.ClientResponse]]
Settle = Callable[[Usage], Awaitable[None]]
DONE = b"data: [DONE]\n\n"


def resuming_relay(
    resume: ResumableStream,
    *,
    request: Callable[..., Awaitable[aiohttp.ClientResponse]],
    base_url: str,
    headers: list[tuple[str, str]],
    options: dict[str, Any],
    meter: UsageMeter,
    settle: Settle,
    metrics: GatewayMetrics,
    model: str | None,
    deadline: float,
) -> Callable[[Callable[[], bool], StreamTimer], ResumingRelay]:
    """What `UpstreamStream` builds its `ResumingRelay` with, given how it tells the client is gone
    and the stream's latency timer (the adaptive capacity's: continuations are timed, their gaps not):
    continuations go to the model's application (`base_url`, its route prefix) with the first
    request's headers and timeouts (`options`), through the same pooled session (`request`)."""
    sent_headers = [(name, value) for name, value in headers if name != "content-type"]
    sent_headers.append(("content-type", "application/json"))

    async def post(path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        return await request(
            "POST",
            URL(base_url + path, encoded=True),
            data=orjson.dumps(body),
            headers=sent_headers,
            allow_redirects=False,
            **options,
        )

    def build(client_gone: Callable[[], bool], timer: StreamTimer) -> ResumingRelay:
        return ResumingRelay(
            resume,
            post=post,
            meter=meter,
            settle=settle,
            metrics=metrics,
            model=model,
            deadline=deadline,
            client_gone=client_gone,
            timer=timer,
        )

    return build


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class ResumingRelay:
    def __init__(
        self,
        resume: ResumableStream,
        *,
        post: Post,
        meter: UsageMeter,
        settle: Settle,
        metrics: GatewayMetrics,
        model: str | None,
        deadline: float,
        client_gone: Callable[[], bool],
        timer: StreamTimer | None = None,
    ) -> None:
        self._resume, self._post, self._meter, self._settle = resume, post, meter, settle
        self._timer = timer or StreamTimer(None, 0.0)
        self._metrics, self._model = metrics, metrics.model_label(model)
        self._deadline, self._client_gone = deadline, client_gone
        self._cut_at: float | None = None  # when the stream broke, until the client's next bytes

    @property
    def interrupted(self) -> bool:
        """The stream's upstream sent a server-side error event (held back): resume, though [DONE] came."""
        return self._resume.engine_error_pending

    async def carry_on(self, exc: BaseException | None, send: Send) -> None:
        """The first upstream stream stopped: `exc` is what its read raised (None: it ended
        without [DONE]). Resume, finish or give up, then end the response."""
        resume, resumes = self._resume, 0
        end = self._end(StreamEnd(cut=cut_of(exc)))
        while True:
            self._cut_at = time.monotonic()
            outcome = after_upstream_end(
                end,
                state=resume.recorder.snapshot(),
                document=resume.document,
                path=resume.path,
                bound=resume.bound,
                resumes=resumes,
                now=time.monotonic(),
                deadline=self._deadline,
                settings=resume.settings,
            )
            if isinstance(outcome, Stop):
                return
            if isinstance(outcome, GiveUp):
                self._metrics.stream_resume_failures.labels(model=self._model, reason=outcome.reason.value).inc()
                log.warning("interrupted stream not resumed (%s): error event sent", outcome.reason.value)
                await self._end_with([DONE], send, first=outcome.error + b"\n\n")  # ours: not the meter's to rewrite
                return
            if isinstance(outcome, Finish):
                await self._end_with([*map(sse, outcome.events), DONE], send)
                return
            assert isinstance(outcome, Resume)
            resumes += 1
            self._metrics.stream_resumes.labels(model=self._model, reason=outcome.reason.value).inc()
            log.warning(
                "upstream stream broke (%s): resuming it, %d of at most %d",
                outcome.reason.value,
                resumes,
                resume.settings.max_resumes,
            )
            if not await self._send(b"".join(self._meter.feed(sse(event)) for event in outcome.events), send):
                return
            broken = None
            for continuation in outcome.continuations:
                broken = await self._continue(continuation, send)
                if broken is not None:
                    break
            if broken is None:  # every unfinished choice has finished: the whole answer's usage, then [DONE]
                final = final_usage_chunk(resume.recorder.snapshot(), client_path=resume.path, n=resume.bound.sequences)
                await self._end_with([sse(final), DONE], send)
                return
            end = broken

    def _end(self, end: StreamEnd) -> StreamEnd:
        """`end` with what the recorder saw: an error event, every choice finished."""
        state, bound = self._resume.recorder.snapshot(), self._resume.bound
        finished = sum(1 for choice in state.choices if choice.finished) == bound.prompts * bound.sequences
        return StreamEnd(
            client_gone=end.client_gone or self._client_gone(),
            saw_done=end.saw_done,
            saw_error_event=state.error_event_seen,
            all_finished=finished,
            cut=end.cut,
            status=end.status,
            engine_error=end.engine_error or self._resume.take_engine_error(),
        )

    async def _continue(self, continuation: Continuation, send: Send) -> StreamEnd | None:
        """Relay one continuation's stream, spliced; None when it ended with its [DONE], else how it stopped."""
        splice = Splice(self._resume.recorder.snapshot(), continuation, self._resume.path)
        self._timer.resumed()  # the wait for its first tokens is the break's, not the engine's load
        try:
            upstream = await self._post(continuation.path, continuation.body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._end(StreamEnd(cut=cut_of(exc)))
        try:
            if upstream.status != 200:
                lost = replica_unavailable(upstream.status, upstream.content_type, upstream.content_length)
                return self._end(StreamEnd(status=upstream.status, unavailable=lost))
            done = await self._relay(upstream, splice, send)
            if done is None:
                return self._end(StreamEnd(client_gone=True))
            upstream.release()
            clean = done and not self._resume.recorder.snapshot().error_event_seen and not self.interrupted
            return None if clean else self._end(StreamEnd(saw_done=done))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._end(StreamEnd(cut=cut_of(exc)))
        finally:
            upstream.close()
            self._count_overhead(splice)

    async def _relay(self, upstream: aiohttp.ClientResponse, splice: Splice, send: Send) -> bool | None:
        """The continuation's events, rewritten, through the meter to the client: whether its
        [DONE] came (None: the client went away)."""
        pending, done = b"", False
        while True:
            chunk = await upstream.content.readany()
            if not chunk:
                return done
            *events, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            out = []
            for event in events:
                data = event.strip()
                if data == b"data: [DONE]":
                    done = True  # the continuation's end, not the client's: the stream's comes last
                elif data.startswith(b"data: {"):
                    try:
                        parsed = orjson.loads(data[len(b"data: ") :])
                    except orjson.JSONDecodeError:
                        continue  # not an event vLLM sends: nothing the client could use
                    if isinstance(parsed, dict):
                        out += [self._meter.feed(sse(rewritten)) for rewritten in splice.rewrite(parsed)]
            if any(out) and self._meter.usage is None:  # tokens, not the final usage (as the relay times them)
                self._timer.chunk(time.monotonic())
            if not await self._send(b"".join(out), send):
                return None

    async def _send(self, body: bytes, send: Send) -> bool:
        """Send `body` to the client (if any); False once the client is known gone."""
        if body:
            if self._cut_at is not None:
                self._metrics.stream_resume_gap.labels(model=self._model).observe(time.monotonic() - self._cut_at)
                self._cut_at = None
            await send({"type": "http.response.body", "body": body, "more_body": True})
        return not self._client_gone()

    async def _end_with(self, events: list[bytes], send: Send, *, first: bytes = b"") -> None:
        """The stream's last events through the meter (after `first`, as is); settled before the
        client gets its end, as the relay does for a whole answer."""
        out = first + b"".join(self._meter.feed(event) for event in events)
        held_back = self._meter.finish()
        await self._settle(self._meter.billed_usage())
        await send({"type": "http.response.body", "body": out + held_back, "more_body": False})

    def _count_overhead(self, splice: Splice) -> None:
        overhead = self._metrics.stream_resume_overhead_tokens
        overhead.labels(model=self._model, kind="prompt").inc(splice.overhead_prompt_tokens)
        overhead.labels(model=self._model, kind="completion").inc(splice.overhead_output_tokens)
        # ... and in the usage ledger with the settlement, as the platform's (llmctl cost's overhead line)
        self._meter.add_overhead(splice.overhead_prompt_tokens, splice.overhead_output_tokens)
