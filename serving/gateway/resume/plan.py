"""The one call the relay makes when an upstream stream stops: what to send and what to ask next.

`after_upstream_end` puts the other modules together: the end's reason and the resume policy
(serving.gateway.resume.policy), then, for a resume, the continuations of the unfinished choices
(serving.gateway.resume.continuation). It returns events as JSON objects (the relay writes them
as SSE `data:` lines through its meter) and never performs I/O.

- `Stop`: the client is gone; send nothing, continue nothing.
- `Finish(events)`: send `events` (a lost final usage, a lost `length` finish), then `[DONE]`.
- `Resume(events, continuations)`: send `events` (the `length` finishes of exhausted choices),
  then each continuation's body to its path, splicing its stream (serving.gateway.resume.splice);
  when the last one ends with its `[DONE]`, send `final_usage_chunk` of the recorder's state, then
  `[DONE]` (a continuation that stops early comes back here, one resume more).
- `GiveUp(error)`: send the error event, then `[DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.gateway.metering.output_bound import OutputBound
from serving.gateway.resume.continuation import Continuation, Exhausted, NotResumable, continuations
from serving.gateway.resume.ending import EndReason, StreamEnd
from serving.gateway.resume.policy import Action, ResumeSettings, decide, error_event
from serving.gateway.resume.splice import final_usage_chunk, length_finish_chunk
from serving.gateway.resume.state import StreamState


@dataclass(frozen=True)
class Stop:
    reason: EndReason


@dataclass(frozen=True)
class Finish:
    reason: EndReason
    events: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Resume:
    reason: EndReason
    events: tuple[dict[str, Any], ...]
    continuations: tuple[Continuation, ...]


@dataclass(frozen=True)
class GiveUp:
    reason: EndReason
    error: bytes  # the SSE `data:` line, without its blank-line end


Outcome = Stop | Finish | Resume | GiveUp


def after_upstream_end(
    end: StreamEnd,
    *,
    state: StreamState,
    document: dict[str, Any],
    path: str,
    bound: OutputBound,
    resumes: int,
    now: float,
    deadline: float,
    settings: ResumeSettings,
) -> Outcome:
    """What follows an upstream stream that stopped as `end` says, with the client holding
    `state`; `document` is the body as the gateway checked it, `bound` its output bound;
    `resumes` continuations were sent already; `now`/`deadline` are time.monotonic() values."""
    decision = decide(end, resumes=resumes, now=now, deadline=deadline, settings=settings)
    if decision.action is Action.STOP:
        return Stop(decision.reason)
    if decision.action is Action.FINISH:
        return Finish(decision.reason)
    if decision.action is Action.GIVE_UP:
        return GiveUp(decision.reason, error_event(decision.message or "The answer was interrupted."))
    if decision.action is Action.COMPLETE:  # every choice had finished: only the end was lost
        return Finish(decision.reason, _final(state, path, bound))
    steps = continuations(document, path, state, bound)
    if isinstance(steps, NotResumable):
        message = f"The answer was interrupted and cannot be resumed: {steps.reason}."
        return GiveUp(decision.reason, error_event(message))
    finishes = tuple(
        length_finish_chunk(state, step.index, client_path=path) for step in steps if isinstance(step, Exhausted)
    )
    remaining = tuple(step for step in steps if isinstance(step, Continuation))
    if not remaining:  # every unfinished choice had generated its whole limit
        return Finish(decision.reason, finishes + _final(state, path, bound))
    return Resume(decision.reason, finishes, remaining)


def _final(state: StreamState, path: str, bound: OutputBound) -> tuple[dict[str, Any], ...]:
    """The whole answer's usage, unless the upstream's final usage already reached the client."""
    if state.final_usage_seen:
        return ()
    return (final_usage_chunk(state, client_path=path, n=bound.sequences),)
