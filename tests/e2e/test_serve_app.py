"""`serving.app:build_app` on the OpenAI-ingress serving paths (haproxy, ray_proxy) builds a Serve
application with Ray Serve LLM. Building needs a Ray runtime: it runs in a child process joined to
the shared dev stack's Ray, so no test starts a cluster of its own."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_the_openai_ingress_app_builds_with_ray_serve_llm(dev_stack):
    built = dev_stack.ray_call(
        "from ray.serve import Application; from infra.render.serve_config import serving_args; "
        "from infra.spec.stack_file import load_stack; from serving.app import build_app; "
        "app = build_app(serving_args(load_stack('local'))); print(type(app).__name__, isinstance(app, Application))"
    )
    assert built == "Application True"
