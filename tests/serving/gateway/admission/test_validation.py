"""Request policy (OWASP LLM10): unit tests of the pure `check_request`, and one
test through the real gateway (uvicorn, real redis-server, fake upstream, official openai
client) showing a refused request never reaches the upstream and costs no quota.

hypothesis is not installed in this venv, so instead of a property test there is a
deterministic sweep over a grid of JSON-ish values for every policed key.
"""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from ops.devstack.local_redis import running_redis
from serving.gateway.admission.validation import PolicyViolation, check_request
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.http.app import create_app
from tests.support.openai_fakes import PROMPT, settings_for
from tests.support.openai_fakes import StreamRecordingUpstream as RecordingUpstream
from tests.support.servers import HANG_BOUND_S, serving

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"
SETTINGS = GatewaySettings(upstream_url="http://upstream:8000")  # defaults: ceiling 4096, n 4, logprobs 5
MESSAGES = [{"role": "user", "content": PROMPT}]


def check(path: str = CHAT, settings: GatewaySettings = SETTINGS, **body) -> PolicyViolation | None:
    return check_request({"model": "tiny", "messages": MESSAGES, **body}, path, settings)


def refused(param: str | None, code: str | None = None, **body) -> PolicyViolation:
    path = body.pop("path", CHAT)
    violation = check(path, **body)
    assert violation is not None and violation.param == param, violation
    if code is not None:
        assert violation.code == code
    return violation


# --- unit: one rule at a time --------------------------------------------------------------------


def test_defaults():
    assert (SETTINGS.max_n, SETTINGS.max_top_logprobs, SETTINGS.allow_logit_bias) == (4, 5, False)


def test_plain_requests_and_other_paths_pass():
    assert check() is None
    assert check(LEGACY, prompt="hi") is None
    assert check(max_tokens=None, n=None, logit_bias=None, top_logprobs=None, logprobs=None) is None
    assert check_request(None, "/v1/models", SETTINGS) is None  # GET, no body
    assert check_request({"input": "x", "max_tokens": 10**9}, "/v1/embeddings", SETTINGS) is None


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_ceiling(param):
    assert check(**{param: 4096}) is None and check(**{param: 1}) is None
    violation = refused(param, "integer_above_max_value", **{param: 4097})
    assert "4096" in violation.message and param in violation.message
    refused(param, "integer_below_min_value", **{param: 0})
    refused(param, "integer_above_max_value", path=LEGACY, **{param: 10**30})
    small = SETTINGS.model_copy(update={"max_tokens_ceiling": 100})
    assert check(settings=small, **{param: 100}) is None and check(settings=small, **{param: 101}) is not None


def test_n_ceiling():
    assert check(n=4) is None
    assert "4" in refused("n", "integer_above_max_value", n=5).message
    refused("n", "integer_below_min_value", n=-1)
    refused("n", n=0)
    refused("best_of", "integer_above_max_value", path=LEGACY, best_of=20)  # same multiplier as n
    assert check(settings=SETTINGS.model_copy(update={"max_n": 8}), n=8) is None


def test_logit_bias_refused_by_default():
    assert check(logit_bias={}) is None and check(logit_bias=None) is None
    violation = refused("logit_bias", "logit_bias_not_allowed", logit_bias={"50256": -100})
    assert "not allowed" in violation.message
    refused("logit_bias", path=LEGACY, logit_bias={"1": 5})
    refused("logit_bias", "invalid_type", logit_bias=[1, 2])
    allowing = SETTINGS.model_copy(update={"allow_logit_bias": True})
    assert check(settings=allowing, logit_bias={"50256": -100}) is None
    assert check(settings=allowing, logit_bias="x") is not None  # still type-checked


def test_logprobs_caps():
    assert check(logprobs=True, top_logprobs=5) is None
    assert "5" in refused("top_logprobs", "integer_above_max_value", logprobs=True, top_logprobs=6).message
    refused("top_logprobs", top_logprobs=-1)
    assert check(LEGACY, prompt="hi", logprobs=5) is None
    refused("logprobs", "integer_above_max_value", path=LEGACY, prompt="hi", logprobs=6)
    refused("logprobs", "invalid_type", logprobs=3)  # chat: logprobs is a boolean
    refused("prompt_logprobs", path=LEGACY, prompt_logprobs=100)  # vLLM extension
    assert check(settings=SETTINGS.model_copy(update={"max_top_logprobs": 20}), top_logprobs=20) is None


def test_min_tokens_cannot_force_output_past_the_ceiling():
    assert check(min_tokens=10) is None
    refused("min_tokens", "integer_above_max_value", min_tokens=100_000)


@pytest.mark.parametrize("value", ["ten", "5000", 10.0, 1e9, True, False, [5], {"v": 5}, float("nan")])
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens", "n", "top_logprobs"])
def test_wrong_types_name_the_param(param, value):
    violation = refused(param, "invalid_type", **{param: value})
    assert param in violation.message


@pytest.mark.parametrize("document", [None, [], ["a"], "text", 5])
@pytest.mark.parametrize("path", [CHAT, LEGACY])
def test_body_must_be_an_object(document, path):
    violation = check_request(document, path, SETTINGS)
    assert violation is not None and violation.param is None and violation.code == "invalid_request_body"


# --- sweep in place of a property test (hypothesis is not installed) ----------------------------

VALUES = [None, 0, 1, 4, 5, 6, 20, 4096, 4097, -1, 10**40, True, "5", "ten", [], [1], {}, {"1": 1}, 2.5]
POLICED = ["max_tokens", "max_completion_tokens", "n", "top_logprobs", "logprobs", "logit_bias"]


def _admitted_within_ceilings(document: dict, path: str, settings: GatewaySettings) -> bool:
    def ok_int(name: str, high: int) -> bool:
        v = document.get(name)
        return v is None or (type(v) is int and v <= high)

    ceiling = settings.max_tokens_ceiling
    return (
        ok_int("max_tokens", ceiling)
        and ok_int("max_completion_tokens", ceiling)
        and ok_int("n", settings.max_n)
        and ok_int("top_logprobs", settings.max_top_logprobs)
        and (
            ok_int("logprobs", settings.max_top_logprobs)
            if path == LEGACY
            else document.get("logprobs") is None or type(document.get("logprobs")) is bool
        )
        and (settings.allow_logit_bias or not document.get("logit_bias"))
    )


def test_sweep_never_raises_and_admits_only_what_fits():
    admitted = 0
    for path in (CHAT, LEGACY):
        for a, b in itertools.combinations(POLICED, 2):
            for va, vb in itertools.product(VALUES, repeat=2):
                document = {"model": "tiny", a: va, b: vb}
                violation = check_request(document, path, SETTINGS)  # must not raise
                if violation is None:
                    admitted += 1
                    assert _admitted_within_ceilings(document, path, SETTINGS), (path, document)
                else:
                    assert violation.param in (a, b) and violation.message
    assert admitted > 0


# --- through the real gateway --------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack():
    with running_redis() as redis_server:
        fake = RecordingUpstream()
        with serving(fake.app()) as upstream_url:
            settings = settings_for(upstream_url, redis_server.url)
            with serving(create_app(settings, RedisKeyStore(redis_server.url))) as gateway:
                yield gateway, fake, redis_server


def test_refused_request_never_reaches_upstream_and_costs_no_quota(stack):
    gateway, upstream, redis_server = stack
    key = create_key_sync(redis_server.url, "acme", "policy", limits={"requests_per_minute": 3})
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)

    first = llm.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=5)
    before = int(first.headers["x-ratelimit-remaining-requests"])
    seen = len(upstream.bodies)

    for bad, param in [
        ({"max_tokens": 4097}, "max_tokens"),
        ({"n": 5}, "n"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"top_logprobs": 6, "logprobs": True}, "top_logprobs"),
        ({"max_tokens": 5, "extra_body": {"max_tokens": "ten"}}, "max_tokens"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            llm.chat.completions.create(model="tiny", messages=MESSAGES, **bad)
        assert caught.value.status_code == 400 and caught.value.param == param
        assert caught.value.type == "invalid_request_error"
    # Not a JSON object: refused at the gateway too.
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    raw = httpx.post(f"{gateway}/v1/chat/completions", content=b"[1, 2]", headers=headers, timeout=HANG_BOUND_S)
    assert raw.status_code == 400
    assert raw.json() == {
        "error": {
            "message": "The request body must be a JSON object.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request_body",
        }
    }
    assert len(upstream.bodies) == seen  # nothing refused reached the upstream

    # Six refusals against a 3-per-minute key, and the next request is admitted with exactly one
    # fewer remaining than before: refusals were not charged (GCRA refills 1 per 20 s; the
    # equality would fail the other way only if this test took 20 s).
    second = llm.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=5)
    assert int(second.headers["x-ratelimit-remaining-requests"]) == before - 1
    assert len(upstream.bodies) == seen + 1
