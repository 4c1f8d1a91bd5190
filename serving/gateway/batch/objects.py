"""File and batch records as stored, and the objects OpenAI's API returns for them.

The shapes follow openai-python's `types/file_object.py`, `types/batch.py`,
`types/batch_request_counts.py` and `types/batch_error.py` (openai 3.57; a test parses every
answer with the installed SDK's own models). Output and error file lines follow OpenAI's batch
guide: `{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
"error": {"code", "message"} | null}`.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW = "24h"

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
# Why a batch stopped before every line ran, and the code its unfinished lines get in the error file.
Ending = Literal["completed", "cancelled", "expired", "stopped"]
ENDING_CODE = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
ENDING_MESSAGE = {
    "cancelled": "This request was not executed: the batch was cancelled.",
    "expired": "This request could not be executed before the completion window expired.",
}


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def request_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FileRecord(_Record):
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    expires_at: int | None = None

    def api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


class LineError(BaseModel):
    """One entry of a batch's `errors.data`: a problem with the input file as a whole."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(_Record):
    id: str
    tenant: str
    key_id: str = Field(description="The key that created it: lines are admitted (and billed) as that key.")
    endpoint: str
    input_file_id: str
    completion_window: str = COMPLETION_WINDOW
    status: Status
    created_at: int
    expires_at: int
    seq: int = Field(description="Creation order within the tenant: the cursor of GET /v1/batches.")
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0  # final counts, set at the end; live ones are counted in Redis
    failed: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[LineError] | None = None
    enqueued: bool = Field(default=False, description="Every line is in the batch's work stream (or answered).")
    input_bytes: int = Field(default=0, description="The input file's size: what validating it holds in memory.")
    footprint: int = Field(default=0, description="Most Redis bytes its lines hold while it runs (batch.quota).")
    ending: Ending | None = None
    stop_code: str | None = None
    stop_message: str | None = None

    def api(self, counts: tuple[int, int] | None = None) -> dict[str, Any]:
        """OpenAI's Batch object; `counts` (completed, failed) while it runs, else the final ones."""
        completed, failed = (
            counts if counts is not None and self.status not in TERMINAL else (self.completed, self.failed)
        )
        errors = None if self.errors is None else {"object": "list", "data": [e.model_dump() for e in self.errors]}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "in_progress_at": self.in_progress_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "errors": errors,
            "metadata": self.metadata,
            "request_counts": {"total": self.total, "completed": completed, "failed": failed},
        }


def output_line(custom_id: str, status_code: int, upstream_request_id: str | None, body: Any) -> dict[str, Any]:
    """A line of the output file (2xx) or the error file (any other status): the response as the endpoint gave it."""
    return {
        "id": request_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": upstream_request_id, "body": body},
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that got no response (expired, cancelled, stopped)."""
    return {"id": request_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
