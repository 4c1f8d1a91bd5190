"""What the stack says about batches (`llmstack:gateway.batch`), a field of serving.gateway.policy.GatewayPolicy."""

from __future__ import annotations

from pydantic import Field

from serving.gateway.strict_model import StrictModel

DAY_S = 86_400.0
# Copies of one file a heavy step may hold at once: the request body, the parsed form's file, its
# text, its lines, the bodies checked from them. One heavy step (an upload, a validation, a
# finalization) runs at a time per gateway process (serving.gateway.batch.runner).
COPIES_IN_MEMORY = 6


class BatchPolicy(StrictModel):
    enabled: bool = Field(
        default=True,
        description="Serve /v1/files and /v1/batches (needs Redis and batch storage). Off: those routes answer 404.")
    max_file_bytes: int = Field(
        default=50_000_000, ge=1024, le=200_000_000,
        description="Largest upload to /v1/files (OpenAI's own cap is 200 MB); larger gets 413.")
    max_lines: int = Field(default=50_000, ge=1, le=50_000, description="Most requests in one batch, as OpenAI.")
    workers: int = Field(
        default=8, ge=0, le=256,
        description="Batch lines each gateway process runs at once (0: this gateway runs none). Lines go "
                    "through admission at the lowest queue tier, so these only use capacity others leave idle.")
    completion_window_s: float = Field(
        default=DAY_S, gt=0, le=DAY_S,
        description="How long a batch may run (OpenAI's `24h` window). Shorter only for tests: lines still "
                    "unfinished then are failed with code batch_expired.")
    lease_s: float = Field(
        default=60.0, ge=1,
        description="A line whose worker stopped renewing its claim for this long (a gateway died) is run "
                    "again by another worker. Renewed every lease_s / 3 while the line runs.")
    sweep_interval_s: float = Field(
        default=1.0, gt=0, le=60,
        description="How often each gateway looks for batches to validate, finalize, cancel or expire.")
    retention_days: int = Field(
        default=30, ge=1, le=365,
        description="Files (inputs and results) and finished batches are kept this long, then deleted: their "
                    "Redis records expire and, on AWS, an S3 lifecycle rule removes the bytes under batches/.")
    max_attempts: int = Field(
        default=3, ge=1, le=20,
        description="Tries per line when the upstream fails (5xx, unreachable); rate-limit waits do not count.")

    def memory_bytes(self) -> int:
        """The most the Batch API's heavy steps hold at once in one gateway process (its pod's
        memory limit adds this); output files larger than inputs are not bounded by it."""
        return COPIES_IN_MEMORY * self.max_file_bytes if self.enabled else 0
