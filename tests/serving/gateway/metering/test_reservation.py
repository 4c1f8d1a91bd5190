"""What a request reserves (serving.gateway.metering.reservation): a prompt bound that cannot under-count,
and output for every prompt and sequence.

Pure tests with values worked out by hand; the bound against a real byte-level BPE tokenizer
and a real chat template; then the attacks through HTTP (real gateway, real redis-server, the
vLLM-like upstream): text the old estimate ignored or under-counted, and prompt arrays.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import Reservation, prompt_bound, reserve
from tests.support.hypothesis import examples
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import directive, running_gateway

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"


def bound(body: bytes, path: str = CHAT, context_length: int | None = None, template_tokens: int = 0) -> int:
    return prompt_bound(
        json.loads(body), len(body), path, context_length=context_length, template_tokens=template_tokens
    )


# --- by hand -------------------------------------------------------------------------------------


def test_the_prompt_bound_by_hand():
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'  # 57 bytes
    assert len(body) == 57
    # 6 JSON values: the root, model, messages, the message, role, content.
    assert bound(body) == 57 + 4 * 6
    assert bound(body, template_tokens=256) == 57 + 24 + 256
    assert bound(body, LEGACY) == 57 + 24  # no chat template on the legacy path
    assert bound(b"{}", CHAT) == 2 + 4
    assert prompt_bound(None, 0, "/v1/models", context_length=None, template_tokens=256) == 0  # a GET


def test_a_media_part_counts_a_whole_context_and_every_prompt_is_capped_at_one():
    image = json.dumps(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                    ],
                }
            ],
        }
    )
    assert bound(image.encode(), context_length=8192) == 8192  # capped at one context
    assert bound(image.encode(), context_length=None) >= 32_768  # unknown context: a large allowance
    long = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 50_000}]}).encode()
    assert bound(long, context_length=4096) == 4096


def test_prompt_arrays_reserve_for_every_prompt_and_sequence():
    def reserved(
        document: dict, body_size: int, *, ceiling: int, context_length: int | None, template_tokens: int
    ) -> Reservation:
        output = output_bound(document, LEGACY, context_length=context_length, ceiling=ceiling)
        return reserve(
            document, body_size, LEGACY, output=output, context_length=context_length, template_tokens=template_tokens
        )

    document = {"model": "m", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 10}
    body = json.dumps(document).encode()
    r = reserved(document, len(body), ceiling=100, context_length=None, template_tokens=256)
    # values: root, model, prompt (3 items + the list), n, max_tokens = 1 + 4 + 3 = 8
    assert r == Reservation(prompt=len(body) + 4 * 8, output=10 * 2 * 3, prompts=3, n=2)
    ids = {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 7}
    capped = reserved(ids, 10_000, ceiling=100, context_length=50, template_tokens=0)
    assert (capped.prompts, capped.prompt, capped.output) == (2, 2 * 50, 14)
    no_max = reserved({"prompt": "x"}, 15, ceiling=64, context_length=None, template_tokens=0)
    assert no_max.output == 16  # vLLM's own default for a completion without max_tokens


# --- against a real tokenizer and chat template --------------------------------------------------


@pytest.fixture(scope="module")
def llama_style():
    """A byte-level BPE trained here (as `make dev`'s tiny model is) and the tiny model's
    Llama-3-style chat template, with its special tokens."""
    import jinja2  # both declared in the test extra: a missing one fails, never skips
    import tokenizers

    from ops.devstack.tiny_model import BOS, CHAT_TEMPLATE, SPECIAL_TOKENS

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the KV cache keeps attention keys and values 你好世界 " * 20], trainer)
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)

    def count(messages: list[dict]) -> int:
        text = template.render(messages=messages, bos_token=BOS, add_generation_prompt=True)
        return len(tokenizer.encode(text).ids)

    return count


messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200),
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=examples(fast=50, deep=200))
@given(conversation=messages)
def test_the_bound_never_under_counts_a_real_tokenizer(llama_style, conversation):
    """Any text - CJK, emoji, control characters - through a real template and tokenizer: the
    gateway's bound, without any template allowance, is never below the real count."""
    body = json.dumps({"model": "tiny", "messages": conversation}, ensure_ascii=False).encode()  # UTF-8, unescaped
    assert llama_style(conversation) <= bound(body)


def test_the_old_estimate_would_under_count_cjk(llama_style):
    text = "語" * 1_000  # a character the tokenizer never saw: three byte tokens each
    real = llama_style([{"role": "user", "content": text}])
    assert real > 3_000 > 1_000 // 4  # what characters / 4 reserved
    assert bound(json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False).encode()) >= real


# --- the attacks, through HTTP ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reserving_gateway(redis_server, upstream):
    # documents and chat_template_kwargs are vLLM extensions: a stack that allows them has them reserved too.
    with running_gateway(
        upstream.url,
        redis_server.url,
        model_context_lengths={"tiny": 100_000},
        allowed_body_extensions=["documents", "chat_template_kwargs"],
    ) as url:
        yield url


def post(reserving_gateway: str, key: str, document: dict, path: str = CHAT) -> httpx.Response:
    body = json.dumps(document, ensure_ascii=False).encode()
    return httpx.post(
        f"{reserving_gateway}{path}",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


BULK = "y" * 20_000
SMUGGLED = {
    "tools": {
        "tools": [
            {"type": "function", "function": {"name": "f", "description": BULK, "parameters": {"type": "object"}}}
        ]
    },
    "tool_call_arguments": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": BULK})}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    },
    "name": {"messages": [{"role": "user", "name": BULK, "content": "hi"}]},
    "documents": {"documents": [{"title": "t", "text": BULK}]},
    "template_kwargs": {"chat_template_kwargs": {"context": BULK}},
    "cjk": {"messages": [{"role": "user", "content": "語" * 7_000}]},
    "emoji": {"messages": [{"role": "user", "content": "🦙" * 5_000}]},
}


@pytest.mark.parametrize("where", sorted(SMUGGLED))
def test_prompt_text_outside_the_message_content_is_reserved(reserving_gateway, upstream, redis_server, where):
    """The attack: a key with a small token rate sends a huge prompt where the old estimate did
    not look (or counted a quarter of it): admitted, and the upstream prefilled all of it."""
    key = create_key_sync(redis_server.url, "acme", f"smuggle-{where}", limits={"tokens_per_minute": 12_000})
    plain = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    assert post(reserving_gateway, key, plain).status_code == 200  # the key works
    seen = len(upstream.bodies)
    refused = post(reserving_gateway, key, {**plain, **SMUGGLED[where]})
    assert refused.status_code == 429, refused.text  # it reserves more than the key's whole minute
    assert refused.json()["error"]["type"] == "tokens" and refused.headers["x-should-retry"] == "false"
    assert len(upstream.bodies) == seen


def test_every_prompt_of_a_completions_request_is_reserved_and_counts_against_max_n(
    reserving_gateway, upstream, redis_server
):
    """/v1/completions with N prompts generates N x n sequences; the old reservation and the
    max_n ceiling counted n alone."""
    key = create_key_sync(redis_server.url, "acme", "arrays", limits={"tokens_per_minute": 3_000})
    one = {"model": "tiny", "max_tokens": 1_000, "prompt": directive(id="one-prompt")}
    assert post(reserving_gateway, key, one, LEGACY).status_code == 200
    four = {**one, "prompt": [directive(id="four-prompts")] + ["again"] * 3}
    too_big = post(reserving_gateway, key, four, LEGACY)
    assert too_big.status_code == 429 and too_big.json()["error"]["type"] == "tokens"
    seen = len(upstream.bodies)
    too_many = post(
        reserving_gateway, key, {"model": "tiny", "max_tokens": 5, "prompt": ["a", "b", "c"], "n": 2}, LEGACY
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"  # 6 sequences > max_n 4
    assert len(upstream.bodies) == seen
