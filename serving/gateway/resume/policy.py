"""What to do when an upstream stream has ended: finish, resume, give up, or stop.

A stream is resumed at most `max_resumes` times and never past the request's own deadline (the
`request_timeout_s` the relay already enforces). Past either, or for an end that may not be
resumed (serving.gateway.resume.ending) or an answer that cannot be continued
(serving.gateway.resume.continuation), the client gets an OpenAI-shaped error event and then the
end marker: never a stream that just stops, which a client could take for a whole answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from serving.gateway.config.resume_policy import ResumeSettings
from serving.gateway.resume.ending import RESUMABLE, EndReason, StreamEnd, classify

ERROR_CODE = "stream_interrupted"


__all__ = ["ERROR_CODE", "Action", "Decision", "ResumeSettings", "decide", "error_event"]


class Action(Enum):
    FINISH = "finish"  # the upstream ended the answer itself (end marker, or its own error event)
    COMPLETE = "complete"  # every choice had finished: send the final usage (if it was lost) and the end marker
    RESUME = "resume"
    GIVE_UP = "give_up"  # send `error_event` and the end marker
    STOP = "stop"  # the client is gone: send nothing, continue nothing


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: EndReason
    message: str | None = None  # why the stream was given up, for the client's error event


def decide(end: StreamEnd, *, resumes: int, now: float, deadline: float, settings: ResumeSettings) -> Decision:
    """The next step after the upstream stopped as `end` says, `resumes` continuations in.
    `now` and `deadline` are time.monotonic() values."""
    reason = classify(end)
    if reason is EndReason.CLIENT_GONE:
        return Decision(Action.STOP, reason)
    if reason in (EndReason.DONE, EndReason.ERROR_EVENT):
        return Decision(Action.FINISH, reason)
    if reason is EndReason.ALL_FINISHED:
        return Decision(Action.COMPLETE, reason)
    if reason not in RESUMABLE:
        return Decision(Action.GIVE_UP, reason, "The model servers failed while generating this answer.")
    if resumes >= settings.max_resumes:
        return Decision(
            Action.GIVE_UP,
            reason,
            "The answer was interrupted more often than this gateway resumes a stream. Please retry.",
        )
    if now >= deadline:
        return Decision(
            Action.GIVE_UP,
            reason,
            "The answer was interrupted and no time was left to resume it within the request's timeout. Please retry.",
        )
    return Decision(Action.RESUME, reason)


def error_event(message: str) -> bytes:
    """The SSE event (without its blank-line end) that tells the client its stream failed: the
    error shape of the OpenAI SDKs' `APIError`, with the status the response line could not carry."""
    error = {"message": message, "type": "server_error", "param": None, "code": ERROR_CODE, "status": 502}
    return b"data: " + json.dumps({"error": error}).encode()
