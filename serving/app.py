"""The Ray Serve application that `serveConfigV2` (and `make dev`) runs.

Its `args` are Ray Serve LLM's own `LLMServingArgs` (`{"llm_configs": [...]}`), rendered
from the stack by `infra.render.serve_config`. This builder hands them to Ray's
`build_openai_app` unchanged: Ray Serve LLM already implements the OpenAI protocol,
streaming, multi-model routing and replica autoscaling. It exists so the cluster image and
the local stack import one entry point that we own and can extend without changing the
rendered manifests.
"""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any]):
    """Serve application builder (`import_path: serving.app:build_app`)."""
    from ray.serve.llm import LLMServingArgs, build_openai_app

    return build_openai_app(LLMServingArgs.model_validate(args))
