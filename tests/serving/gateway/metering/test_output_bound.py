"""The gateway's output bound (serving.gateway.metering.output_bound) against the pinned vLLM's own code.

Hypothesis builds request bodies - both limit fields, either, neither, null, booleans, floats
like 4.0, numeric strings, huge integers, `n`, prompt lists, `min_tokens`, `ignore_eos`, `echo`,
beam search - and each goes through the gateway's checks (serving.gateway.admission.validation) and,
as the upstream would get it (serving.gateway.admission.admitter.upstream_request), through vLLM's own
request classes: `model_validate` (what vLLM refuses), `build_tok_params` (which limit field it
reads), `get_max_tokens` (its default and the context cap), `to_sampling_params` (what the engine
gets) and `prompt_to_seq` (how many prompts). What the engine may generate is
`SamplingParams.max_tokens * n` per prompt. The gateway must refuse a body or bound it from
above, and name it exactly when it forwards the body's own limit.

vLLM is part of the dev environment: importing it here is the point (the gateway itself never
does). Costs about 10 s (vLLM's import).
"""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.renderers.inputs.preprocess import prompt_to_seq

from serving.gateway.admission.admitter import upstream_request
from serving.gateway.admission.validation import check_request
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.metering.output_bound import CHAT, COMPLETIONS, OutputBound, output_bound

CEILING = 4096
SETTINGS = GatewaySettings(
    upstream_url="http://u:1",
    max_tokens_ceiling=CEILING,
    max_n=4,
    allowed_body_extensions=["min_tokens", "ignore_eos", "echo", "use_beam_search", "max_completion_tokens"],
)

# Every spelling of a limit a lax parser might read as a number: JSON integers (small, at and
# past the ceiling, past 64 bits), null, booleans, floats with and without a fraction, numeric strings.


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` 3 times in 4, so that bodies combining several valid fields are common."""
    return st.integers(0, 3).flatmap(lambda i: valid if i else invalid)


limits = mostly(
    st.one_of(st.integers(1, 5), st.integers(1, CEILING), st.just(CEILING), st.none()),
    st.one_of(
        st.integers(-2, 0),
        st.just(CEILING + 1),
        st.integers(2**63, 2**70),
        st.booleans(),
        st.sampled_from([4.0, 4096.0, 0.5, 1e3]),
        st.sampled_from(["4096", "1", "4.0", "x"]),
    ),
)
flags = mostly(st.one_of(st.booleans(), st.none()), st.sampled_from(["true", "yes", 1, 0, "false"]))
ABSENT = object()


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just(ABSENT), strategy)


prompts = st.one_of(
    st.just("hello"),
    st.lists(st.sampled_from(["a", "b c"]), min_size=1, max_size=3),
    st.lists(st.integers(0, 99), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=2), min_size=1, max_size=3),
)

contexts = st.sampled_from([None, 64, 2048, 100_000])  # the model's context length as the gateway knows it
prompt_lengths = st.integers(0, 40)  # the prompt's length in tokens as vLLM counts it
any_body = st.tuples(
    st.sampled_from([CHAT, COMPLETIONS]),
    st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": limits,
            "max_completion_tokens": limits,
            "n": mostly(st.one_of(st.integers(1, 4), st.none()), st.sampled_from([0, 5, 2.0, "2", True])),
            "min_tokens": st.one_of(st.integers(0, 3), st.integers(0, 40), st.none()),
            "ignore_eos": flags,
            "echo": flags,
            "use_beam_search": mostly(st.just(False), flags),
            "stream": st.booleans(),
        },
    ),
    prompts,
    contexts,
    prompt_lengths,
)
# The attack's shape, drawn often: chat with both limits, valid and (mostly) different.
both_limits = st.tuples(
    st.just(CHAT),
    st.fixed_dictionaries(
        {"max_tokens": st.integers(1, CEILING), "max_completion_tokens": st.integers(1, CEILING)},
        optional={"n": st.integers(1, 4), "stream": st.booleans(), "min_tokens": st.integers(0, 3)},
    ),
    prompts,
    contexts,
    prompt_lengths,
)
# No limit at all: vLLM's defaults, the context's end, the gateway's ceiling.
no_limit = st.tuples(
    st.sampled_from([CHAT, COMPLETIONS]),
    st.fixed_dictionaries({}, optional={"n": st.integers(1, 4), "stream": st.booleans()}),
    prompts,
    contexts,
    prompt_lengths,
)
bodies = st.one_of(any_body, any_body, both_limits, no_limit)


def request_body(path: str, fields: dict[str, Any], prompt: Any) -> dict[str, Any]:
    body = {"model": "tiny", **fields}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else json.dumps(prompt)}]
    else:
        body["prompt"] = prompt
    return body


def engine_output(path: str, upstream_body: dict[str, Any], max_model_len: int, prompt_length: int) -> int | None:
    """What vLLM's own code lets the engine generate for `upstream_body`: every prompt's
    SamplingParams.max_tokens times its n. None when vLLM refuses the body."""
    model = ChatCompletionRequest if path == CHAT else CompletionRequest
    try:
        request = model.model_validate(upstream_body)
        if path == CHAT:  # the limit field chat reads, as its own tokenization parameters take it (0: none)
            limit = request.build_tok_params(SimpleNamespace(max_model_len=max_model_len)).max_output_tokens or None
        else:
            limit = request.max_tokens
        if request.use_beam_search:
            return -1  # beam search: no SamplingParams at all
        max_tokens = get_max_tokens(
            max_model_len, limit, prompt_length, {}, None, truncate_prompt_tokens=request.truncate_prompt_tokens
        )
        params = request.to_sampling_params(max_tokens, {})
    except (pydantic.ValidationError, VLLMValidationError, ValueError):
        return None
    prompt_count = 1 if path == CHAT else len(prompt_to_seq(request.prompt))
    return params.max_tokens * params.n * prompt_count


def sends_its_own_limit(path: str, body: dict[str, Any]) -> bool:
    if path == CHAT:
        return body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None
    return True  # completions: its max_tokens, or vLLM's default of 16


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_the_bound_is_what_vllm_lets_the_engine_generate_or_the_body_is_refused(case):
    path, fields, prompt, context_length, prompt_length = case
    body = request_body(path, {k: v for k, v in fields.items() if v is not ABSENT}, prompt)
    refused = check_request(body, path, SETTINGS)
    max_model_len = context_length or 100_000
    if refused is not None:
        seen["refused"] += 1
        if engine_output(path, body, max_model_len, prompt_length) is not None:
            seen["refused, vLLM would accept"] += 1
        return
    bound = output_bound(body, path, context_length=context_length, ceiling=CEILING)
    upstream = upstream_request(body, path, stream=body.get("stream") is True, added_max_tokens=bound.added_max_tokens)
    prompt_length = min(prompt_length, max_model_len - 1)
    generated = engine_output(path, upstream, max_model_len, prompt_length)
    if generated is None:
        seen["bounded, vLLM refuses"] += 1
        return
    assert generated != -1, "beam search was admitted"
    assert 0 < generated <= bound.total, (body, bound, generated)
    if path == CHAT and body.get("max_tokens") not in (None, body.get("max_completion_tokens") or 0):
        seen["both chat limits, different"] += 1
    if (
        bound.added_max_tokens is None
        and sends_its_own_limit(path, body)
        and bound.per_sequence <= (max_model_len - prompt_length)
    ):
        assert generated == bound.total, (body, bound, generated)  # its own limit, forwarded: exactly
        seen["exact"] += 1
    else:
        seen["bounded by the context or the ceiling"] += 1


seen: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def every_branch_was_exercised():
    seen.clear()
    yield
    # A property that never reached a branch proved nothing about it.
    for branch in (
        "refused",
        "refused, vLLM would accept",
        "exact",
        "bounded by the context or the ceiling",
        "both chat limits, different",
    ):
        assert seen[branch] >= 3, (branch, dict(seen))


def test_the_attack_body_is_bounded_by_max_completion_tokens():
    """vLLM's chat reads max_completion_tokens first: a body with both may not reserve the other."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 4096,
    }
    assert output_bound(body, CHAT, context_length=None, ceiling=CEILING) == OutputBound(per_sequence=4096)
    assert engine_output(CHAT, body, 100_000, 10) == 4096


def test_a_completion_without_max_tokens_gets_vllms_default_not_the_ceiling():
    body = {"model": "tiny", "prompt": ["a", "b"], "n": 2}
    bound = output_bound(body, COMPLETIONS, context_length=None, ceiling=CEILING)
    assert bound == OutputBound(per_sequence=16, sequences=2, prompts=2)
    assert engine_output(COMPLETIONS, body, 100_000, 10) == bound.total == 64


@pytest.mark.parametrize(
    "fields",
    [
        {"use_beam_search": True},
        {"use_beam_search": "yes"},
        {"max_tokens": 4.0},
        {"max_completion_tokens": "4096"},
        {"echo": "true"},
        {"n": True},
    ],
)
def test_bodies_whose_output_cannot_be_bounded_are_refused(fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    refused = check_request(body, CHAT, SETTINGS)
    assert refused is not None and refused.param == next(iter(fields))
