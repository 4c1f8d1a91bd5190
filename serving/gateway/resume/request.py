"""What the relay needs to resume one admitted stream: the body the gateway checked (and sends
upstream), the route, its output bound, the recorder of what the client got, and the settings.

The admitter builds it (`resumable`) for a streamed completion when the stack turns resuming on;
the meter calls `client_chunk` for every event it parses, so the recorder sees exactly what the
client gets, in the client's coordinates, and the token ids the gateway asked for reach the
client only if it asked for them too. A server-side error event (the engine stopped under the
stream: serving.gateway.resume.ending.is_engine_error_event) is held back from the client and
noted (`take_engine_error`), so the relay resumes the stream instead of ending it with an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.gateway.config.resume_policy import ResumeSettings
from serving.gateway.metering.output_bound import OutputBound
from serving.gateway.resume.ending import is_engine_error_event
from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamRecorder, client_view, with_token_ids


@dataclass
class ResumableStream:
    document: dict[str, Any]  # the upstream body, token ids asked for
    path: str
    bound: OutputBound
    settings: ResumeSettings
    client_asked_token_ids: bool
    recorder: StreamRecorder = field(init=False)
    engine_error_pending: bool = field(init=False, default=False)  # a held-back server-side error event

    def __post_init__(self) -> None:
        self.recorder = StreamRecorder(self.path)

    def client_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Record `chunk` (as the client gets it) and return it without the ids the client did not
        ask for; None (send nothing) for a server-side error event, which is noted instead."""
        if is_engine_error_event(chunk):
            self.engine_error_pending = True
            return None
        self.recorder.record(chunk)
        return client_view(chunk, client_asked_token_ids=self.client_asked_token_ids)

    def take_engine_error(self) -> bool:
        """Whether a server-side error event was held back since the last call."""
        pending, self.engine_error_pending = self.engine_error_pending, False
        return pending


def resumable(
    document: dict[str, Any] | None, path: str, *, stream: bool, bound: OutputBound, settings: ResumeSettings
) -> ResumableStream | None:
    """The resume context of a request whose upstream body is `document`; None when it is not a
    streamed completion or the stack does not resume streams."""
    if document is None or not stream or path not in (CHAT, COMPLETIONS) or not settings.active:
        return None
    return ResumableStream(
        document=with_token_ids(document),
        path=path,
        bound=bound,
        settings=settings,
        client_asked_token_ids=document.get("return_token_ids") is True,
    )
