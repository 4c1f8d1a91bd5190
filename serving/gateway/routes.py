"""Which Ray Serve application a request goes to: the one serving the model it names.

On the direct serving path each model is its own Serve application under its own route
prefix (`infra.render.serve_config.model_routes`, rendered into the gateway's settings as
`model_routes`). Requests that name no routed model (`GET /v1/models`, an unknown model) go
to `/`, where an application lists every model and answers the rest with a 404.
"""

from __future__ import annotations

from collections.abc import Mapping


def upstream_prefix_for(model: str | None, model_routes: Mapping[str, str]) -> str:
    """The path prefix to put before `/v1/...` upstream: `/tiny-chat` for a routed model,
    "" otherwise. The prefix comes from the settings, never from the request."""
    if model is None:
        return ""
    return model_routes.get(model, "").rstrip("/")
