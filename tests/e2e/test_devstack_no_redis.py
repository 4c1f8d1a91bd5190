"""`make dev` on a machine without redis-server: the gateway keeps keys and limits in its own
memory, says so, and the whole path still serves. Real Ray Serve, CPU vLLM and gateway; only
redis-server is hidden, by a PATH of links to every other program (vLLM needs the rest).
"""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from infra.spec.stack_file import PROJECT_ROOT
from tests.support.devstack import DevStack

pytestmark = pytest.mark.slow

ONE_MODEL_STACK = PROJECT_ROOT / "tests" / "stacks" / "Pulumi.autoscale.yaml"  # one tiny model: starts fastest


def path_without(program: str, folder: Path) -> str:
    """A PATH whose only folder links every program on the current PATH except `program`."""
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name != program and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(folder)


def test_without_redis_server_keys_live_in_the_gateway(tmp_path):
    stack = DevStack(str(ONE_MODEL_STACK), env={"PATH": path_without("redis-server", tmp_path / "bin")})
    try:
        assert stack.ready["redis_url"] is None
        assert any("redis-server is not installed" in line for line in stack.stderr)
        llm = openai.OpenAI(
            base_url=stack.ready["base_url"], api_key=stack.ready["api_key"], max_retries=0, timeout=120
        )
        answer = llm.chat.completions.create(
            model=stack.ready["models"][0], max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=stack.ready["base_url"], api_key="sk-llm-wrong", max_retries=0).models.list()
    finally:
        assert stack.stop() == 0
