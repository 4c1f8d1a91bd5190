"""The base of the gateway's settings models (policy, queue, batch): strict and frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    # Unknown keys are typos or version skew between the renderer and the image: fail loudly.
    # Frozen: settings read at start never change under a running gateway.
    model_config = ConfigDict(extra="forbid", frozen=True)
