"""The stack's stream-resume settings (`gateway.stream_resume`): whether the relay continues a
stream whose replica died on another one, and how often (serving.gateway.resume)."""

from __future__ import annotations

from pydantic import Field

from serving.gateway.config.strict_model import StrictModel


class ResumeSettings(StrictModel):
    """Continuing a stream whose replica died on another replica (serving.gateway.resume,
    serving.gateway.upstream.resuming_relay): the client reads one whole answer, billed once."""

    enabled: bool = Field(
        False,
        description="Continue a stream whose upstream replica died mid-answer (connection reset, body cut, idle "
        "timeout, 502/503) on another replica, spliced into the stream the client reads and billed once. "
        "When on, streamed bodies also ask vLLM for token ids (return_token_ids), so a greedy answer "
        "continues exactly; the client gets them only if it asked. Off by default.",
    )
    max_resumes: int = Field(2, ge=0, le=10, description="Continuations one request may have; 0 turns resuming off.")

    @property
    def active(self) -> bool:
        return self.enabled and self.max_resumes > 0
