"""The Serve application builders: the model list that answers at `/` on the direct path."""

from __future__ import annotations

import pytest

from serving.app import ModelListArgs, answer

ARGS = ModelListArgs.model_validate(
    {
        "models": [
            {"id": "tiny-chat", "route_prefix": "/tiny-chat", "max_model_len": 512},
            {"id": "org/Model-1.5", "route_prefix": "/model-1-5", "max_model_len": 4096},
        ]
    }
)


def test_lists_every_model_in_openai_shape():
    status, body = answer(ARGS, "GET", "/v1/models", created=7)
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["created"], m["max_model_len"]) for m in body["data"]] == [
        ("tiny-chat", "model", 7, 512),
        ("org/Model-1.5", "model", 7, 4096),
    ]
    assert answer(ARGS, "GET", "/v1/models/org/Model-1.5", created=7) == (200, body["data"][1])


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("GET", "/v1/models/nope"), ("GET", "/"), ("POST", "/v1/models")],
)
def test_anything_else_is_a_404_that_says_where_models_live(method, path):
    status, body = answer(ARGS, method, path, created=0)
    assert status == 404
    assert "tiny-chat: /tiny-chat/v1/..." in body["error"]["message"]


def test_the_builder_makes_a_serve_application_without_cpus():
    from ray.serve import Application
    from ray.serve._private.build_app import build_app as build_serve_app

    from serving.app import build_model_list_app

    app = build_model_list_app(ARGS.model_dump())
    assert isinstance(app, Application)
    [deployment] = build_serve_app(app, name="models").deployments
    assert deployment.ray_actor_options["num_cpus"] == 0  # fits beside HAProxy on a `num-cpus: 0` head
