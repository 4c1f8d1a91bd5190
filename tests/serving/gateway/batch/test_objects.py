"""The objects the Batch API answers with, against the installed `openai` SDK's own models: every
field the SDK knows, no field it does not, values it accepts (validated, not just constructed)."""

from __future__ import annotations

from openai.types import Batch, FileDeleted, FileObject

from serving.gateway.batch.objects import BatchRecord, FileRecord, LineError


def test_file_object_matches_the_sdk() -> None:
    record = FileRecord(id="file-0", tenant="t", bytes=10, created_at=1, filename="in.jsonl", purpose="batch")
    assert set(record.api()) == set(FileObject.model_fields)
    FileObject.model_validate(record.api(), strict=True)
    FileDeleted.model_validate({"id": "file-0", "object": "file", "deleted": True}, strict=True)


def test_batch_object_matches_the_sdk_in_every_status() -> None:
    sdk_only = {"model", "usage"}  # optional in the SDK; this gateway does not set them
    for status in (
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ):
        record = BatchRecord(
            id="batch_0",
            tenant="t",
            key_id="k",
            endpoint="/v1/chat/completions",
            input_file_id="file-0",
            status=status,
            created_at=1,
            expires_at=2,
            seq=1,
            metadata={"a": "b"},
            total=3,
            completed=1,
            failed=2,
            errors=[LineError(code="c", message="m", line=1)],
        )
        answer = record.api((5, 6))
        assert set(answer) == set(Batch.model_fields) - sdk_only
        batch = Batch.model_validate(answer, strict=True)
        counts = (5, 6) if status not in ("failed", "completed", "expired", "cancelled") else (1, 2)
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == counts
