"""Media URLs, as an attacker with a valid key sends them: a multimodal engine fetches every
http(s) URL it finds in a message part from inside the VPC, so the gateway lets through inline
`data:` URLs only, plus the hosts the stack names (serving.gateway.admission.media_urls). Every spelling
and every place vLLM reads a URL from is tried through real HTTP against a real gateway; a
refused request never reaches the upstream, and an accepted one reaches it as sent. (vLLM's own
check with the list the engine is rendered with: tests/infra/render/test_serve_config.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.servers import HANG_BOUND_S

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
PNG = "data:image/png;base64,iVBORw0KGgo="
ALLOWED = "images.example.com"


def image(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts, model: str = "tiny") -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}],
    }


def post(base: str, key: str, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{base}{path}",
        content=content,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


@pytest.fixture(scope="module")
def data_only(start_gateway):
    """A gateway whose stack names no media domains (the default)."""
    with start_gateway() as (api, _):
        yield api


@pytest.fixture(scope="module")
def with_domain(start_gateway):
    """A gateway whose stack allows one media host, except for model `other` (its own empty list)."""
    with start_gateway(allowed_media_domains=[ALLOWED], model_media_domains={"other": []}) as (api, _):
        yield api


REMOTE_SPELLINGS = [
    METADATA,
    "HTTP://169.254.169.254/",
    "Http://169.254.169.254/",
    " http://169.254.169.254/",
    "\thttp://169.254.169.254/",
    "http:/169.254.169.254/",
    "//169.254.169.254/latest",
    "file:///etc/passwd",
    "FILE:///proc/self/environ",
    "ftp://169.254.169.254/",
    f"https://{ALLOWED}/cat.png",
    "http://[fd00:ec2::254]/",
    " data:image/png;base64,AAAA",  # vLLM's data: test is on the first five characters: a space makes it a URL
]


@pytest.mark.parametrize("url", REMOTE_SPELLINGS)
def test_without_named_domains_only_data_urls_pass(data_only, recorded, key, url):
    refused = post(data_only, key, chat(image(url)))
    assert refused.status_code == 400, refused.text  # the old gateway forwarded every one of them
    error = refused.json()["error"]
    assert error["code"] == "media_url_not_allowed" and error["param"] == "messages[0].content[1].image_url.url"
    assert url.strip() not in error["message"]  # never echoed
    assert recorded.seen == []


PARTS_VLLM_FETCHES = [
    ("audio_url", {"type": "audio_url", "audio_url": {"url": METADATA}}),
    ("video_url", {"type": "video_url", "video_url": {"url": METADATA}}),
    ("input_image", {"type": "input_image", "image_url": METADATA}),  # Responses-style: a bare string
    ("untyped", {"image_url": METADATA}),  # no `type`: vLLM goes by the keys
    ("untyped object", {"video_url": {"url": METADATA}}),
    ("uuid overrides type", {"type": "text", "text": "hi", "uuid": "u1", "image_url": METADATA}),
    ("file", {"type": "file", "file": {"file_data": METADATA, "filename": "x.pdf"}}),
    ("nested", {"type": "text", "text": "hi", "extra": [{"image_url": {"url": METADATA}}]}),
]


@pytest.mark.parametrize(("name", "part"), PARTS_VLLM_FETCHES, ids=[name for name, _ in PARTS_VLLM_FETCHES])
def test_every_part_that_carries_a_url_is_checked(data_only, recorded, key, name, part):
    refused = post(data_only, key, chat(part))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "media_url_not_allowed"
    assert recorded.seen == []


def test_urls_in_any_message_are_checked(data_only, recorded, key):
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "tool_call_id": "t", "content": [image(METADATA)]},
        ],
    }
    refused = post(data_only, key, body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[3].content[0].image_url.url"
    assert recorded.seen == []


@pytest.mark.parametrize("url", [{"url": METADATA}, [METADATA], 42, True])
def test_a_url_that_is_not_a_string_is_refused(data_only, recorded, key, url):
    refused = post(data_only, key, chat(image(url)))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_type"
    assert recorded.seen == []


def test_a_repeated_url_key_is_refused_so_both_parsers_read_one_url(data_only, recorded, key):
    """Python keeps the last of two keys, other parsers the first. Already refused at 68f58cc
    (the body parser refuses repeated keys): kept so that no parser change can reopen it."""
    body = (
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
        b'{"url": "' + PNG.encode() + b'", "url": "' + METADATA.encode() + b'"}}]}]}'
    )
    refused = post(data_only, key, body)
    assert refused.status_code == 400 and "repeats the key" in refused.json()["error"]["message"]
    assert recorded.seen == []


@pytest.mark.parametrize(
    "part",
    [
        b'{"type": "image_url", "image\\u005furl": {"url": "http://169.254.169.254/"}}',  # an escaped key
        b'{"type": "image_url", "image_url": {"\\u0075rl": "\\u0068ttp://169.254.169.254/"}}',  # escaped key and URL
        b'{"type": "image_url", "image_url": {"url": "http:\\/\\/169.254.169.254\\/"}}',  # escaped slashes
    ],
)
def test_json_escapes_are_read_as_the_engine_reads_them(data_only, recorded, key, part):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": [' + part + b"]}]}"
    refused = post(data_only, key, body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "media_url_not_allowed"
    assert recorded.seen == []


@pytest.mark.parametrize(
    "extra",
    [
        {"mm_payload": "tensors"},
        {"multi_modal_data": {"image": METADATA}},
        {"prompt": [{"prompt": "hi", "multi_modal_data": {"image": METADATA}}]},
    ],
)
def test_completions_carry_no_media(data_only, recorded, key, extra):
    """/v1/completions takes text or token ids only. Already refused at 68f58cc (unknown field,
    strict prompt types): kept as the attack."""
    refused = post(data_only, key, {"model": "tiny", "prompt": "hi", **extra}, path="/v1/completions")
    assert refused.status_code == 400
    assert recorded.seen == []


@pytest.mark.parametrize(
    "part",
    [
        image(PNG),
        image("DATA:image/png;base64,iVBORw0KGgo="),
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},  # vLLM makes it a data: URL
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ],
)
def test_inline_media_reaches_the_upstream_as_sent(data_only, recorded, key, part):
    body = json.dumps(chat(part)).encode()
    assert post(data_only, key, body).status_code == 200
    [seen] = recorded.seen
    assert json.loads(seen.body) == json.loads(body)  # as sent (usage fields may be added, none removed)


def test_an_allowed_host_passes_written_plainly(with_domain, recorded, key):
    body = json.dumps(
        chat(
            image(f"https://{ALLOWED}/cats/1.png?size=2"),
            {"type": "audio_url", "audio_url": {"url": f"http://{ALLOWED}:8443/a.wav"}},
        )
    ).encode()
    assert post(with_domain, key, body).status_code == 200
    [seen] = recorded.seen
    assert json.loads(seen.body)["messages"] == json.loads(body)["messages"]


ALLOWED_HOST_TRICKS = [
    f"https://{ALLOWED}@169.254.169.254/",
    f"https://user:pw@{ALLOWED}/x",
    f"https://{ALLOWED}:443@169.254.169.254/",
    f"https://{ALLOWED}\\@169.254.169.254/",
    f"https://{ALLOWED}.evil.com/",
    f"https://evil.com/{ALLOWED}",
    f"https://{ALLOWED}./x",
    "https://IMAGES.example.com/x",
    f"HTTPS://{ALLOWED}/x",
    f" https://{ALLOWED}/x",
    f"https://{ALLOWED}/x\ny",
    f"https://{ALLOWED}/x y",
    f"//{ALLOWED}/x",
    f"https:{ALLOWED}/x",
    f"https://{ALLOWED}%2e169.254.169.254/",
    "https://169.254.169.254/",
    "http://0xa9fea9fe/",
    "http://2852039166/",
    "http://0251.0376.0251.0376/",
    "http://[::ffff:a9fe:a9fe]/",
    "http://169.254.169.254.nip.io/",
]


@pytest.mark.parametrize("url", ALLOWED_HOST_TRICKS)
def test_tricks_around_an_allowed_host_are_refused(with_domain, recorded, key, url):
    refused = post(with_domain, key, chat(image(url)))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "media_url_not_allowed"
    assert recorded.seen == []


def test_a_models_own_list_replaces_the_gateways(with_domain, recorded, key):
    refused = post(with_domain, key, chat(image(f"https://{ALLOWED}/x.png"), model="other"))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "media_url_not_allowed"
    assert post(with_domain, key, chat(image(PNG), model="other")).status_code == 200
    assert len(recorded.seen) == 1


def test_the_openai_client_gets_the_refusal_as_a_bad_request(data_only, recorded, key):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{data_only}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": METADATA}},
                    ],
                }
            ],
        )
    assert refused.value.code == "media_url_not_allowed"
    assert recorded.seen == []
