"""LoRA adapters on the shared dev stack, called with the official openai client straight at the
model's Serve application: `tiny-chat:<adapter>` is fetched from the local S3 on its first request
(as a replica fetches from the model cache in the cluster) and really applied: its greedy answer
differs from the base's and from the other adapter's. The gateway's side (who may use which
adapter) is tested with the gateway."""

from __future__ import annotations

import openai
import pytest

from infra.spec.stack_file import load_stack

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Write a query that lists every customer."}]


def greedy(client: openai.OpenAI, model: str) -> list[int | str]:
    answer = client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=16, temperature=0, seed=0, logprobs=True
    )
    assert answer.model == model
    assert answer.choices[0].logprobs is not None
    return [t.token for t in answer.choices[0].logprobs.content or []]


@pytest.fixture(scope="module")
def serve_client(dev_stack) -> openai.OpenAI:
    url = dev_stack.ready["model_urls"]["tiny-chat"]
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def test_every_adapter_of_the_stack_answers_and_changes_the_answer(serve_client, e2e_stack_file):
    lora = load_stack(e2e_stack_file).model("tiny-chat").lora
    assert lora is not None and [a.id for a in lora.adapters] == ["sql", "pirate"]
    base = greedy(serve_client, "tiny-chat")
    answers = {adapter.id: greedy(serve_client, f"tiny-chat:{adapter.id}") for adapter in lora.adapters}
    for adapter, tokens in answers.items():
        assert tokens, adapter
        assert tokens != base, f"tiny-chat:{adapter} answered exactly as the base: the adapter was not applied"
    assert answers["sql"] != answers["pirate"]
    # Greedy and loaded: asking again gives the same answer (the adapter stays what it was).
    assert greedy(serve_client, "tiny-chat:sql") == answers["sql"]


def test_an_adapter_the_bucket_does_not_hold_is_refused(serve_client):
    with pytest.raises(openai.APIStatusError) as refused:
        serve_client.chat.completions.create(model="tiny-chat:nope", messages=PROMPT, max_tokens=4)
    assert refused.value.status_code in (400, 404)
