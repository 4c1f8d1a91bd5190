"""The relay's calls to serving.gateway.resume, in the order the lead wires them, over the fake
engine's events: record what the client gets, cut, plan, continue, splice, record again."""

from __future__ import annotations

from typing import Any

from serving.gateway.metering.output_bound import OutputBound
from serving.gateway.resume.continuation import Continuation, Exhausted, NotResumable, continuations
from serving.gateway.resume.splice import Splice, final_usage_chunk, length_finish_chunk
from serving.gateway.resume.state import StreamRecorder, StreamState
from tests.serving.gateway.resume import fake_engine


def texts(events: list[dict[str, Any]], path: str) -> dict[int, str]:
    """Each choice's text as a client reading `events` puts it together."""
    out: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices") or []:
            piece = choice["delta"].get("content") if path.endswith("chat/completions") else choice.get("text")
            out[choice["index"]] = out.get(choice["index"], "") + (piece or "")
    return out


def finishes(events: list[dict[str, Any]]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for e in events for c in e.get("choices") or [] if c.get("finish_reason")}


def resumed(
    path: str, document: dict[str, Any], bound: OutputBound, cuts: list[int], *, stops: bool = False
) -> tuple[list[dict[str, Any]], StreamState, list[Splice]]:
    """The client's events when the upstream is cut after `cuts[0]` events of the original, then
    each continuation after `cuts[1]` of its events, and so on (the last stream runs to its end)."""
    recorder = StreamRecorder(path)
    client: list[dict[str, Any]] = []
    splices: list[Splice] = []

    def relay(events: list[dict[str, Any] | str], limit: int | None, splice: Splice | None) -> None:
        for event in events[:limit]:
            if isinstance(event, str):
                continue  # [DONE]: the relay holds it back until the end
            for out in [event] if splice is None else splice.rewrite(event):
                recorder.record(out)
                client.append(out)

    original = fake_engine.stream(path, {**document, "return_token_ids": True}, stops=stops)
    relay(original, cuts[0] if cuts else None, None)
    for cut in [*cuts[1:], None] if cuts else []:
        steps = continuations(document, path, recorder.snapshot(), bound)
        assert not isinstance(steps, NotResumable), steps
        for step in steps:
            state = recorder.snapshot()
            if isinstance(step, Exhausted):
                out = length_finish_chunk(state, step.index, client_path=path)
                recorder.record(out)
                client.append(out)
                continue
            assert isinstance(step, Continuation)
            splice = Splice(state, step, path)
            splices.append(splice)
            relay(fake_engine.stream(step.path, step.body, stops=stops, chunk_id="other", created=5), cut, splice)
            cut = None  # only the first continuation of a round is cut again
    state = recorder.snapshot()
    if cuts:
        final = final_usage_chunk(state, client_path=path, n=bound.sequences)
        client = [e for e in client if e.get("choices")] + [final]
    return client, state, splices
