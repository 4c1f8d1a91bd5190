"""How a batch line names its caller to admission: an entry of the ASGI scope, which only code in
this process can set (uvicorn builds the scope of every request from the network)."""

from __future__ import annotations

from dataclasses import dataclass

from serving.gateway.auth.key_format import KeyRecord

BATCH_CALLER = "llmstack.batch_caller"


@dataclass(frozen=True)
class BatchCaller:
    """The key that created the batch (read again for every line, so a revoked key stops it)
    and the queue tier its lines wait in."""

    key_id: str
    tier: str

    def record(self, key: KeyRecord) -> KeyRecord:
        """The key as admission sees it for a batch line: at the batch tier, whatever its own."""
        return key.model_copy(update={"tier": self.tier})
