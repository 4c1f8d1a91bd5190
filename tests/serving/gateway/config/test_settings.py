"""The gateway's settings as a pod gets them: the environment infra renders loads, a bad variable is
named, and the gateway imports without Ray, vLLM, torch, Pulumi or our other packages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from infra.render.gateway import gateway_objects
from infra.spec.stack_file import PROJECT_ROOT
from serving.gateway.config.settings import SettingsError, load_settings


def test_the_rendered_deployment_env_loads(example_stack):
    """The contract with infra/render/gateway.py: the env it renders is what the gateway accepts."""
    deployment = next(o for o in gateway_objects(example_stack) if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert not any("value" in e for e in container["env"] if e["name"] == "LLMSTACK_REDIS_URL")  # a Secret
    settings = load_settings({**env, "LLMSTACK_REDIS_URL": "redis://redis:6379/0"})
    assert settings.metrics_port == example_stack.gateway.metrics_port == container["ports"][0]["containerPort"]
    assert settings.models == [m.model_name for m in example_stack.models]
    assert settings.default_limits.model_dump() == example_stack.gateway.default_limits.model_dump()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "LLMSTACK_UPSTREAM_URL"),
        ({"LLMSTACK_UPSTREAM_URL": "serve:8000"}, "LLMSTACK_UPSTREAM_URL"),
        ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": "{port: 1"}, "LLMSTACK_GATEWAY_SETTINGS"),
        ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": '{"prot": 1}'}, "'prot'"),
        (
            {"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": '{"redis_url": "redis://x"}'},
            "LLMSTACK_REDIS_URL",
        ),
        ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_PORT": "eighty"}, "LLMSTACK_GATEWAY_PORT"),
        ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_REDIS_URL": "http://not-redis"}, "LLMSTACK_REDIS_URL"),
        ({"LLMSTACK_UPSTREAM_URL": "http://serve:8000/v1"}, "LLMSTACK_UPSTREAM_URL"),
    ],
)
def test_bad_settings_name_the_variable(env, named):
    with pytest.raises(SettingsError, match=re.escape(named)) as caught:
        load_settings(env)
    assert "\n" not in str(caught.value)


def test_gateway_imports_without_ray_vllm_torch_pulumi_or_our_other_packages():
    poison = "import sys\nfor m in ('ray', 'vllm', 'torch', 'pulumi', 'infra', 'ops'): sys.modules[m] = None\n"
    code = poison + "import serving.gateway.http.app, serving.gateway.__main__\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize(
    ("adapters", "says"),
    [
        ({"nope": ["sql"]}, "not in models"),
        ({"tiny": ["a:b"]}, "must be a folder name"),
        ({"tiny": ["../x"]}, "must be a folder name"),
        ({"tiny": ["a/b"]}, "must be a folder name"),
    ],
)
def test_adapters_must_be_plain_ids_on_served_bases(adapters, says):
    settings = json.dumps({"models": ["tiny"], "model_adapters": adapters})
    with pytest.raises(SettingsError, match=re.escape(says)):
        load_settings({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": settings})
    good = json.dumps({"models": ["tiny"], "model_adapters": {"tiny": ["sql", "pirate-v2.1"]}})
    loaded = load_settings({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": good})
    assert loaded.model_adapters == {"tiny": ["sql", "pirate-v2.1"]}
