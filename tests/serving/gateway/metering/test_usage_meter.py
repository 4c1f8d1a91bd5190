"""Billing: what a response is billed (serving.gateway.metering.usage_meter).

Pure tests of the meter, then the attacks through HTTP: the real gateway app under uvicorn,
the real proxy, a real redis-server and the vLLM-like recording upstream of conftest. What a
request was billed is read where the gateway records it: its access line and the key's daily
counter in Redis.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from ops.harness.stub_upstream import sse
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import key_daily_key
from serving.gateway.metering.reservation import Reservation
from serving.gateway.metering.usage_meter import UsageMeter, client_usage_wishes, request_usage_upstream
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import daily_used, directive, key_id_of, running_gateway
from tests.support.waiting import eventually

TEMPLATE_TOKENS = 256  # GatewayPolicy's default chat_template_tokens, written out by hand


def chunk(index: int, text: str, usage: dict | None = None) -> bytes:
    payload: dict = {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": {"content": text}}]}
    if usage is not None:
        payload["usage"] = usage
    return sse(payload)


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def meter(reservation: Reservation, **wishes: bool) -> UsageMeter:
    return UsageMeter(stream=True, reservation=reservation, **wishes)


# --- the meter, pure -------------------------------------------------------------------------------


def test_a_cut_stream_is_billed_its_reservation_until_every_sequence_has_finished():
    m = meter(Reservation(prompt=100, output=40, n=2))
    m.feed(
        chunk(0, "a", usage(7, 1))
        + chunk(1, "b", usage(7, 2))
        + chunk(0, "cd", usage(7, 3))
        + chunk(1, "efg", usage(7, 5))
    )
    # Cut with both sequences running: the engine may be any way further along. The prompt is known.
    assert not m.finished and m.billed() == 7 + 40
    m.feed(sse({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}], "usage": usage(7, 4)}))
    assert m.billed() == 7 + 40  # one still running
    m.feed(sse({"choices": [{"index": 1, "delta": {"content": "y"}, "finish_reason": "stop"}], "usage": usage(7, 6)}))
    # Both finished: nothing more is generated. vLLM counts each sequence in its own chunks: summed.
    assert m.billed() == 7 + 4 + 6


def test_tokens_not_chunks():
    m = meter(Reservation(prompt=50, output=30))
    m.feed(chunk(0, "abc", usage(5, 3)) + chunk(0, "def", usage(5, 6)))  # 3 tokens a chunk (speculative decoding)
    assert m.billed() == 5 + 30  # cut while running: the reservation
    m.feed(sse("[DONE]"))
    m.finish()
    assert m.billed() == 5 + 6  # ended: nothing more was generated


def test_a_partly_received_event_means_more_was_sent_than_counted():
    m = meter(Reservation(prompt=50, output=30))
    whole = chunk(0, "a", usage(5, 1))
    m.feed(whole + chunk(0, "b", usage(5, 2))[:20])
    assert m.billed() == 5 + 30


def test_a_stream_without_usage_is_billed_its_reservation_never_zero():
    for finished in (False, True):
        m = meter(Reservation(prompt=50, output=30))
        m.feed(chunk(0, "a") + chunk(0, "b"))
        if finished:
            m.finish()
        assert m.billed() == 80


def test_final_usage_wins_and_upstream_refusals_cost_nothing():
    m = meter(Reservation(prompt=50, output=30))
    m.feed(chunk(0, "a", usage(5, 1)) + sse({"choices": [], "usage": usage(5, 9)}) + sse("[DONE]"))
    m.finish()
    assert m.billed() == 14
    refused = meter(Reservation(prompt=50, output=30))
    refused.status = 400
    assert refused.billed() == 0


def test_prompt_arrays_map_sequences_to_their_prompts():
    r = Reservation(prompt=100, output=80, prompts=2, n=2)  # indexes: prompt * n + sequence
    m = meter(r)
    m.feed(chunk(0, "a", usage(10, 1)) + chunk(1, "b", usage(10, 1)))
    # Prompt 1 not heard of yet: its prompt may be read already, so the bound.
    assert m.billed() == 100 + 80
    m.feed(chunk(2, "c", usage(20, 4)) + chunk(3, "d", usage(20, 1)))
    assert m.billed() == 10 + 20 + 80  # every prompt's exact count
    m.finish()
    assert m.billed() == 10 + 20 + (1 + 1 + 4 + 1)


def test_usage_is_asked_of_the_upstream_and_given_to_the_client_only_as_asked():
    assert request_usage_upstream({"stream": True})["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    assert client_usage_wishes({}) == (False, False)
    assert client_usage_wishes({"stream_options": {"include_usage": True}}) == (True, False)
    assert client_usage_wishes({"stream_options": {"continuous_usage_stats": True}}) == (False, False)  # as vLLM
    both = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert client_usage_wishes(both) == (True, True)
    stream = chunk(0, "a", usage(5, 1)) + sse({"choices": [], "usage": usage(5, 1)}) + sse("[DONE]")
    for final, continuous in [(False, False), (True, False), (True, True)]:
        m = meter(Reservation(prompt=50, output=30), client_final_usage=final, client_continuous_usage=continuous)
        out = b"".join(m.feed(stream[i : i + 9]) for i in range(0, len(stream), 9)) + m.finish()
        events = [json.loads(e[len(b"data: ") :]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
        assert [e["choices"][0]["delta"]["content"] for e in events if e["choices"]] == ["a"]
        assert ("usage" in events[0]) is continuous
        assert any(not e["choices"] for e in events) is final
        assert m.billed() == 6 and out.endswith(b"data: [DONE]\n\n")


def test_events_the_fast_parser_reads_otherwise_are_still_counted_and_stripped():
    # The meter parses events with orjson, which refuses a lone surrogate escape and reads an
    # integer past 64 bits as a float: both must count as the standard library reads them.
    lone = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "\\ud800"}}], '
        b'"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}\n\n'
    )
    # An output reservation of 1: what is billed past it is what the meter counted.
    m = meter(Reservation(prompt=50, output=1), client_final_usage=False, client_continuous_usage=False)
    out = m.feed(lone)
    assert b"usage" not in out and json.loads(out[len(b"data: ") :])["choices"][0]["delta"]["content"] == "\ud800"
    assert m.billed() == 5 + 3
    m.feed(chunk(0, "b", usage(5, 2**70)))
    assert m.billed() == 5 + 2**70


def test_crlf_and_lf_events_are_read_alike():
    stream = chunk(0, "a", usage(5, 1)) + chunk(0, "bc", usage(5, 3)) + sse({"choices": [], "usage": usage(5, 3)})
    for ends in (b"\n\n", b"\r\n\r\n"):
        m = meter(Reservation(prompt=50, output=30), client_final_usage=False, client_continuous_usage=False)
        data = stream.replace(b"\n\n", ends) + b"data: [DONE]" + ends
        out = b"".join(m.feed(data[i : i + 7]) for i in range(0, len(data), 7)) + m.finish()
        assert out.count(ends) == 3 and b"usage" not in out and out.endswith(b"data: [DONE]" + ends)
        assert m.billed() == 8


# Texts that test where an event's text ends: quotes, backslashes before a quote, braces, the
# words "usage" and "content", characters beyond ASCII. Each is written as vLLM writes it.
TRICKY_TEXTS = [
    "plain",
    'a "quoted" word',
    "back\\slash",
    "ends with \\",
    '\\"',
    '\\\\"}',
    'say "usage": {"prompt_tokens": 1}}',
    '"content": "x"',
    "é ☃ 😀",
    "\n\t",
    "}]}",
    "",
]


def vllm_event(
    text: str,
    completion: int,
    finish: str | None = None,
    *,
    compact: bool = True,
    index: int = 0,
    chat: bool = True,
    details: bool = False,
) -> bytes:
    """A chunk as vLLM 0.32 writes it (pydantic's compact JSON, usage last), or spaced as json.dumps
    does; a chat chunk (delta content) or a completion's (text)."""
    choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
    payload = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{**choice, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion, "completion_tokens": completion},
    }
    if details:  # what vLLM adds with enable_prompt_tokens_details
        payload["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
    separators = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(payload, separators=separators, ensure_ascii=False).encode() + b"\n\n"


def data_events(out: bytes) -> list[dict]:
    return [json.loads(e[len(b"data: ") :]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]


def test_events_read_by_the_bytes_they_repeat_are_billed_and_stripped_as_parsed_ones():
    # After one event parsed in full, the meter reads the next ones by the bytes they share with it;
    # what it bills and what the client gets must be what parsing each event would give.
    for compact, chat, details in [(True, True, False), (False, True, True), (False, False, False)]:
        events = [
            vllm_event(text, 2 * (i + 1), compact=compact, chat=chat, details=details)
            for i, text in enumerate(TRICKY_TEXTS)
        ]
        stream = b"".join(events)
        for continuous, piece in [(False, len(stream)), (False, 1), (False, 13), (True, 13)]:
            m = meter(
                Reservation(prompt=50, output=1), client_final_usage=continuous, client_continuous_usage=continuous
            )
            out = b"".join(m.feed(stream[i : i + piece]) for i in range(0, len(stream), piece))
            expected = data_events(stream)
            if not continuous:
                expected = [{k: v for k, v in e.items() if k != "usage"} for e in expected]
            assert data_events(out) == expected
            last = 2 * len(TRICKY_TEXTS)
            assert m.billed() == 7 + last  # cut: past an output reservation of 1, the last usage
            if not compact:  # every later event was read by its bytes: it keeps the upstream's spacing
                assert all(b'"index": 0, ' in e for e in out.split(b"\n\n")[1:-1])
            m.feed(vllm_event("end", last + 1, finish="stop", compact=compact, chat=chat) + sse("[DONE]"))
            m.finish()
            assert m.billed() == 7 + last + 1


def test_the_sequences_of_one_stream_are_each_read_by_their_own_bytes():
    m = meter(Reservation(prompt=50, output=1, n=2), client_final_usage=False, client_continuous_usage=False)
    out = b""
    for step in range(1, 6):  # vLLM's usage per chunk counts its own sequence: 1 token a step for 0, 3 for 1
        out += m.feed(
            vllm_event(f"a{step}", step, compact=False) + vllm_event(f'b"{step}', 3 * step, compact=False, index=1)
        )
    assert all(b'"index": ' in e for e in out.split(b"\n\n")[2:-1])  # after each one's first: read by its bytes
    assert [e["choices"][0]["index"] for e in data_events(out)] == [0, 1] * 5 and b"usage" not in out
    assert m.billed() == 7 + 5 + 15  # each sequence's last count, summed


def test_an_event_that_does_not_repeat_the_bytes_is_parsed_in_full():
    m = meter(Reservation(prompt=50, output=1), client_final_usage=False, client_continuous_usage=False)
    m.feed(vllm_event("a", 1))
    # The text as an escape orjson refuses (read as the standard library reads it), usage past 64 bits,
    # usage that is not an object, a raw control character (not JSON: relayed as it came, not counted).
    lone = vllm_event("LONE", 2).replace(b"LONE", b"\\ud800")
    out = m.feed(lone)
    assert data_events(out)[0]["choices"][0]["delta"]["content"] == "\ud800" and b"usage" not in out
    assert m.billed() == 7 + 2
    raw = vllm_event("b", 3).replace(b'"b"', b'"b\x01"')
    assert m.feed(raw) == raw and m.billed() == 7 + 2
    not_object = vllm_event("c", 4).replace(b'"usage":{', b'"usage":[{').replace(b"}}\n\n", b"}]}\n\n")
    assert json.loads(m.feed(not_object)[len(b"data: ") :])["usage"] == [usage(7, 4)] and m.billed() == 7 + 2
    m.feed(vllm_event("d", 2**70))
    assert m.billed() == 7 + 2**70
    m.feed(vllm_event("e", 2**70 + 1, finish="length"))  # the finish reason differs from the repeated bytes
    assert m.billed() == 7 + 2**70 + 1  # its one sequence finished: exactly its count


def test_a_large_json_body_is_billed_its_usage_without_keeping_a_copy():
    decoy = 'say "usage": {"prompt_tokens": 1} ' * 50_000  # escaped inside a string: not a key
    answer = {
        "id": "x",
        "choices": [{"index": 0, "message": {"content": decoy}}],
        "usage": usage(123, 456),
        "prompt_logprobs": [{"1": -0.5}] * 300_000,
    }
    body = json.dumps(answer).encode()
    assert len(body) > 5_000_000  # past the old 4 MB copy, usage far from both ends
    m = UsageMeter(stream=False, reservation=Reservation(prompt=10, output=10))
    relayed = b"".join(m.feed(body[i : i + 65_536]) for i in range(0, len(body), 65_536)) + m.finish()
    assert relayed == body and m.billed() == 123 + 456
    cut = UsageMeter(stream=False, reservation=Reservation(prompt=10, output=10))
    cut.feed(body[: len(body) // 2])  # usage is in the first half: known even though the end never came
    assert cut.billed() == 579


# --- through HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(redis_server, upstream):
    with running_gateway(upstream.url, redis_server.url, model_context_lengths={"tiny": 100_000}) as url:
        yield url


def chat_body(text: str, **fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], **fields}).encode()


def reserved_for(body: bytes, top_level_fields: int, max_tokens: int) -> int:
    """The reservation worked out by hand for a one-message chat body: its bytes, 4 tokens per
    JSON value (the root, each top-level field, the message list, the message, its role and
    content), the chat template's allowance, and max_tokens."""
    values = 1 + top_level_fields + 1 + 2
    return len(body) + 4 * values + TEMPLATE_TOKENS + max_tokens


def post(gateway: str, key: str, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        f"{gateway}{path}",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def read_then_leave(gateway: str, key: str, body: bytes, content_chunks: int) -> list[str]:
    """Stream `body`, read `content_chunks` events with content, then close the connection."""
    seen: list[str] = []
    with httpx.stream(
        "POST",
        f"{gateway}/v1/chat/completions",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as response:
        assert response.status_code == 200, response.read()
        if content_chunks:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        seen.append(line)
                        if len(seen) == content_chunks:
                            break
    return seen


def billed(access_lines, key: str) -> int:
    line = eventually(lambda: access_lines.of(key_id_of(key)), "no access line: the request never ended")[-1]
    return line["prompt_tokens"] + line["completion_tokens"]


def test_leaving_at_the_headers_is_billed_the_reservation_not_zero(gateway, upstream, redis_server, access_lines):
    """The attack: a long prompt, streamed, and the connection closed as soon as the headers
    come. The upstream has read (prefilled) the prompt; no usage ever reaches the gateway."""
    key = create_key_sync(redis_server.url, "acme", "leaver")
    body = chat_body(directive(id="leave", pause_after=0) + " " + "long prompt " * 500, stream=True, max_tokens=50)
    read_then_leave(gateway, key, body, content_chunks=0)
    expected = reserved_for(body, top_level_fields=4, max_tokens=50)
    assert billed(access_lines, key) == expected
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == expected
    assert expected >= sum(upstream.generated["leave"].values())


def test_a_cut_stream_is_billed_its_reservation_with_the_prompts_exact_count(
    gateway, upstream, redis_server, access_lines
):
    """Read two chunks of a stream and leave: the engine runs on until the cut reaches it, so no
    count the gateway saw bounds what it generated. The prompt's count is exact once seen."""
    key = create_key_sync(redis_server.url, "acme", "cutter")
    body = chat_body(directive(id="spec", tokens=12, per_chunk=3, pause_after=2), stream=True, max_tokens=50)
    assert len(read_then_leave(gateway, key, body, content_chunks=2)) == 2
    generated = upstream.generated["spec"]
    assert generated["completion"] == 6  # two chunks of three tokens
    eventually(lambda: "spec" in upstream.closed, "the gateway never closed the upstream stream")
    assert billed(access_lines, key) == generated["prompt"] + 50
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == generated["prompt"] + 50
    assert upstream.bodies[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("value", ["true", 1, "yes", "on"])
def test_a_stream_flag_vllm_would_coerce_is_refused(gateway, upstream, redis_server, value):
    """To vLLM's lax pydantic these are all `stream: true`; to the gateway they were not a stream,
    so it parsed SSE as JSON and billed the reservation only."""
    key = create_key_sync(redis_server.url, "acme", "coerce")
    seen = len(upstream.bodies)
    for body in (chat_body("hi", stream=value), chat_body("hi", stream=True, stream_options={"include_usage": value})):
        refused = post(gateway, key, body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid_type"
    assert len(upstream.bodies) == seen


def test_a_large_answer_is_billed_its_usage(gateway, upstream, redis_server, access_lines):
    """Usage of a body past 4 MB used to be lost (the gateway stopped copying it), billing the
    reservation instead of what the upstream reported."""
    key = create_key_sync(redis_server.url, "acme", "large")
    body = chat_body(directive(id="large", tokens=7, body_pad=5_000_000), max_tokens=4000)
    answer = post(gateway, key, body)
    assert answer.status_code == 200 and len(answer.content) > 5_000_000
    generated = upstream.generated["large"]
    assert (
        billed(access_lines, key)
        == generated["prompt"] + generated["completion"]
        == sum(answer.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    )


def open_stream(gateway: str, key: str, body: bytes) -> socket.socket:
    """A raw client: a socket with a small receive buffer (so it soon stops taking bytes when it
    stops reading), the request sent, the response's headers and first events read."""
    parts = urlsplit(gateway)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the TCP window
    client.settimeout(HANG_BOUND_S)
    client.connect((parts.hostname, parts.port))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while received.count(b'"content":" tok') < 3:
        data = client.recv(4096)
        assert data, received
        received += data
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    return client


def test_a_client_that_stops_reading_and_leaves_is_billed_what_the_engine_generated(
    gateway, upstream, redis_server, access_lines
):
    """The attack: stream with top_logprobs (a few KB a token), read a few events, stop reading
    while the engine keeps generating at its own pace, then close the connection. After the close,
    uvicorn's send() returns silently, so a relay that trusted it drained what it had buffered into
    nothing and was billed as caught up: 15-47% of the generated tokens went unbilled."""
    key = create_key_sync(redis_server.url, "acme", "stopped-reading")
    body = chat_body(
        directive(id="stopped", tokens=4000, per_chunk=8, interval=0.005, event_pad=4000, abort_delay=0.1),
        stream=True,
        max_tokens=4000,
    )
    client = open_stream(gateway, key, body)
    # Not reading: the engine runs on; past the socket buffers (megabytes on loopback), the
    # gateway's sends to this client block, and so do the upstream's sends to the gateway.
    eventually(lambda: upstream.generated["stopped"]["completion"] >= 2400, "the engine never got ahead")
    client.close()
    eventually(lambda: "stopped" in upstream.stopped, "the engine never stopped")
    generated = upstream.generated["stopped"]
    reservation = reserved_for(body, top_level_fields=4, max_tokens=4000)
    assert generated["prompt"] + generated["completion"] <= billed(access_lines, key) <= reservation
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == billed(access_lines, key)


def test_a_client_that_reads_everything_is_billed_exactly_what_was_generated(
    gateway, upstream, redis_server, access_lines
):
    key = create_key_sync(redis_server.url, "acme", "read-all")
    body = chat_body(directive(id="read-all", tokens=300, interval=0.001, event_pad=1000), stream=True, max_tokens=1500)
    with httpx.stream(
        "POST",
        f"{gateway}/v1/chat/completions",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as response:
        assert response.status_code == 200
        text = response.read()
    assert text.endswith(b"data: [DONE]\n\n")
    generated = upstream.generated["read-all"]
    assert generated["completion"] == 300
    assert billed(access_lines, key) == generated["prompt"] + generated["completion"]
