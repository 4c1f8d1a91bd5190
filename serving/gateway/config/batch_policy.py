"""What the stack says about batches (`llmstack:gateway.batch`), a field of
serving.gateway.config.gateway_policy.GatewayPolicy."""

from __future__ import annotations

from pydantic import Field

from serving.gateway.config.strict_model import StrictModel

DAY_S = 86_400.0
# Copies of one file a heavy step may hold at once: the request body, the parsed form's file, its
# text, its lines, the bodies checked from them. Heavy steps (uploads, validations, finalizations)
# and downloads share memory_bytes() per gateway process (serving.gateway.batch.memory).
COPIES_IN_MEMORY = 6
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and the purpose field around an uploaded file
# A download sends its file in chunks of this size, each counted in memory_bytes() while it is sent.
DOWNLOAD_CHUNK_BYTES = 256 * 1024


class BatchPolicy(StrictModel):
    enabled: bool = Field(
        default=True,
        description="Serve /v1/files and /v1/batches (needs Redis and batch storage). Off: those routes answer 404.",
    )
    max_file_bytes: int = Field(
        default=50_000_000,
        ge=1024,
        le=200_000_000,
        description="Largest upload to /v1/files (OpenAI's own cap is 200 MB); larger gets 413.",
    )
    max_lines: int = Field(default=50_000, ge=1, le=50_000, description="Most requests in one batch, as OpenAI.")
    workers: int = Field(
        default=8,
        ge=0,
        le=256,
        description="Batch lines each gateway process runs at once (0: this gateway runs none). Lines go "
        "through admission at the lowest queue tier, so these only use capacity others leave idle.",
    )
    completion_window_s: float = Field(
        default=DAY_S,
        gt=0,
        le=DAY_S,
        description="How long a batch may run (OpenAI's `24h` window). Shorter only for tests: lines still "
        "unfinished then are failed with code batch_expired.",
    )
    lease_s: float = Field(
        default=60.0,
        ge=1,
        description="A line whose worker stopped renewing its claim for this long (a gateway died) is run "
        "again by another worker. Renewed every lease_s / 3 while the line runs.",
    )
    sweep_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often each gateway looks for batches to validate, finalize, cancel or expire.",
    )
    retention_days: int = Field(
        default=30,
        ge=1,
        le=365,
        description="Files (inputs and results) and finished batches are kept this long, then deleted: their "
        "Redis records expire and, on AWS, an S3 lifecycle rule removes the bytes under batches/.",
    )
    max_active_batches_per_tenant: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="Batches one tenant may have not yet final (validating, in progress, finalizing, cancelling); "
        "creating one more gets 429 too_many_active_batches.",
    )
    max_active_batches: int = Field(
        default=128,
        ge=1,
        le=100_000,
        description="Batches all tenants together may have not yet final; past it creates get 503 "
        "batch_capacity_full (retry later), so no tenant can fill the gateway's Redis.",
    )
    max_queued_bytes_per_tenant: int = Field(
        default=32_000_000,
        ge=10_000,
        description="Redis bytes one tenant's active batches may hold: each line's custom_id twice, a reference "
        "to its body (bodies are in batch storage, never in Redis), the answers of lines refused up "
        "front. About 4 batches of 50,000 lines with 20-character custom_ids. Past it: 429 "
        "batch_queue_full.",
    )
    max_queued_bytes: int = Field(
        default=256_000_000,
        ge=10_000,
        description="Redis bytes all tenants' active batches may hold together: a quarter of a cache.t4g.small's "
        "memory. Past it: 503 batch_capacity_full.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Tries per line when the upstream fails (5xx, unreachable); rate-limit waits do not count.",
    )

    def memory_bytes(self) -> int:
        """The most the Batch API's uploads, validations, finalizations and downloads hold at once
        in one gateway process (its pod's memory limit adds this): serving.gateway.batch.memory."""
        return COPIES_IN_MEMORY * (self.max_file_bytes + MULTIPART_OVERHEAD) if self.enabled else 0
