"""Waiting for a batch of the Batch API to reach a status, through the official client."""

from __future__ import annotations

import openai
from openai.types import Batch

from tests.support.waiting import eventually


def batch_reaching(client: openai.OpenAI, batch_id: str, statuses: set[str]) -> Batch:
    """The batch once its status is one of `statuses`; AssertionError naming the batch if it
    never gets there (the bound is only against a hang)."""

    def reached() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return eventually(reached, f"batch {batch_id} reaches one of {sorted(statuses)}", poll_s=0.05)
