"""The gateway on the stub upstream, as the gateway benchmarks start it: each process answers
when the caller gets it, the gateway relays the stub's answer to the official openai client, and
both processes are gone once the block ends."""

from __future__ import annotations

import openai
import pytest

from ops.harness.stub_gateway import running_gateway, running_stub
from serving.gateway.auth.keys import create_key_sync
from tests.support.servers import HANG_BOUND_S

pytestmark = pytest.mark.slow  # starts the stub and gateway processes

QUESTION = [{"role": "user", "content": "What is a KV cache?"}]


def ask(url: str, key: str) -> str | None:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    return api.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16).choices[0].message.content


def test_the_gateway_on_redis_relays_the_stub_and_both_stop_with_the_block(tmp_path, redis_server):
    with (
        running_stub(tmp_path / "stub.log") as stub,
        running_gateway(
            tmp_path / "gateway.log", upstream=stub.url, redis_url=redis_server.url, settings={"models": ["tiny"]}
        ) as gateway,
    ):
        assert ask(gateway.url, create_key_sync(redis_server.url, "harness", "harness")) == " tok" * 8
        assert gateway.url == f"http://127.0.0.1:{gateway.port}"
    assert stub.process.poll() is not None and gateway.process.poll() is not None


def test_a_gateway_without_redis_gets_its_command_line(tmp_path):
    key_file = tmp_path / "gateway.key"
    with (
        running_stub(tmp_path / "stub.log") as stub,
        running_gateway(
            tmp_path / "gateway.log",
            upstream=stub.url,
            redis_url="",
            settings={"models": ["tiny"]},
            args=("--dev-key-file", str(key_file)),
        ) as gateway,
    ):
        assert ask(gateway.url, key_file.read_text().strip()) == " tok" * 8
