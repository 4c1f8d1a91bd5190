"""The Ray Serve applications that `serveConfigV2` (and `make dev`) runs.

`build_app`'s `args` are Ray Serve LLM's own `LLMServingArgs` (`{"llm_configs": [...]}`),
rendered from the stack by `infra.render.serve_config`; it hands them to Ray's
`build_openai_app` unchanged. Ray Serve LLM already implements the OpenAI protocol,
streaming, routing and replica autoscaling. With direct streaming (one application per model,
see `infra.render.serve_config`) Ray's builder returns the model's `LLMServer` as the ingress.

`build_model_list_app` is the small application beside them on the direct path: each model's
own application answers only under its route prefix, so `GET /v1/models` at `/` lists them all
here, and a model request that reached `/` is told where that model lives.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from ray.serve import Application


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path: serving.app:build_app`)."""
    from ray.serve.llm import LLMServingArgs, build_openai_app

    return build_openai_app(LLMServingArgs.model_validate(args))


class ListedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="The served name clients put in `model`.")
    route_prefix: str = Field(description="Where Serve serves this model's OpenAI API.")
    max_model_len: int = Field(description="Longest prompt + output, in tokens (vLLM's model card field).")


class ModelListArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[ListedModel] = Field(min_length=1, description="Every model of the stack.")


def model_card(model: ListedModel, created: int) -> dict[str, Any]:
    """An OpenAI model object, with vLLM's `max_model_len` extension."""
    return {
        "id": model.id,
        "object": "model",
        "created": created,
        "owned_by": "llmstack",
        "max_model_len": model.max_model_len,
    }


def answer(args: ModelListArgs, method: str, path: str, created: int) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for a request that reached `/`. Pure, so tests call it directly."""
    cards = {m.id: model_card(m, created) for m in args.models}
    if method == "GET" and path.rstrip("/") == "/v1/models":
        return 200, {"object": "list", "data": list(cards.values())}
    if method == "GET" and path.startswith("/v1/models/") and path.removeprefix("/v1/models/") in cards:
        return 200, cards[path.removeprefix("/v1/models/")]
    where = ", ".join(f"{m.id}: {m.route_prefix.rstrip('/')}/v1/..." for m in args.models)
    message = f"{path} is served per model, under the model's route prefix ({where})"
    return 404, {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}


def build_model_list_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path: serving.app:build_model_list_app`)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    validated = ModelListArgs.model_validate(args)

    class ModelList:
        def __init__(self) -> None:
            self._created = int(time.time())

        async def __call__(self, request: Request) -> JSONResponse:
            status, body = answer(validated, request.method, request.url.path, self._created)
            return JSONResponse(body, status_code=status)

    # No logical CPU: it runs beside HAProxy on any node, a head with `num-cpus: 0` included.
    # Applied as a call, not as a decorator: the class statement keeps the plain class's type.
    return serve.deployment(name="ModelList", ray_actor_options={"num_cpus": 0})(ModelList).bind()
