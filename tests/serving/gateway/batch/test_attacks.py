"""The Batch API's routes attacked through HTTP: spellings of paths and ids that must not reach a
lookup, another tenant's ids, uploads too large (declared or chunked) or not JSONL, bodies the
create route must refuse. Nothing of any of it may reach the upstream."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.support.gateway import raw_request
from tests.support.servers import HANG_BOUND_S
from tests.support.waiting import eventually

LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
}


def multipart(content: bytes, purpose: str = "batch", field: str = "file") -> tuple[bytes, str]:
    boundary = "llmstackboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


@pytest.fixture(scope="module")
def owned(gateway, make_key) -> dict[str, str]:
    """A finished batch of tenant `victim-co`: its key and ids."""
    key = make_key("victim-co")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    uploaded = client.files.create(file=("in.jsonl", (json.dumps(LINE) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = eventually(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, f"batch {batch.id} completed"
    )
    return {"key": key, "file": uploaded.id, "batch": batch.id, "output": str(done.output_file_id)}


@pytest.fixture(scope="module")
def attacker(make_key) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_key('attacker-co')}"}


def test_every_route_wants_a_key(gateway, owned, recorded) -> None:
    for method, target in (
        ("POST", "/v1/files"),
        ("GET", f"/v1/files/{owned['file']}"),
        ("GET", f"/v1/files/{owned['file']}/content"),
        ("DELETE", f"/v1/files/{owned['file']}"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches"),
        ("GET", f"/v1/batches/{owned['batch']}"),
        ("POST", f"/v1/batches/{owned['batch']}/cancel"),
    ):
        for headers in ({}, {"Authorization": "Bearer sk-llmstack-not-a-key"}):
            status, _, _ = raw_request(gateway, method, target, headers=headers)
            assert status == 401, (method, target, headers)
    assert recorded.seen == []


def test_other_spellings_of_a_path_or_id_reach_no_lookup(gateway, owned, recorded) -> None:
    file_id, batch_id = owned["file"], owned["batch"]
    victim = {"Authorization": f"Bearer {owned['key']}"}
    for target in (
        f"/v1/files/%2566{file_id[1:]}",
        f"/v1/files/{file_id}/",
        f"/v1/files//{file_id}",
        f"/v1/files/{file_id.upper()}",
        f"/v1/files/{file_id}%252Fcontent",
        f"/v1/files/./{file_id}",
        f"/v1/batches/../files/{file_id}",
        f"/v1/files/{file_id};x/content",
        f"/v1/files/{file_id}/content/",
        f"/v1/files/{file_id}x",
        f"/v1/batches/{batch_id}/cancel/",
        f"/v1/batches/%2e%2e/files/{file_id}",
        f"/v1/Batches/{batch_id}",
        f"/V1/batches/{batch_id}",
        f"/v1/batches/{batch_id}%00",
        "/v1/files/file-*",
        f"/v1/batches/{batch_id}/../../files/{file_id}",
    ):
        status, _, body = raw_request(gateway, "GET", target, headers=victim)
        assert status == 404, (target, status)
        assert file_id.encode() not in body or b"Unknown path" in body
    assert recorded.seen == []


def test_a_once_encoded_path_is_the_route_it_decodes_to_with_its_tenant_check(gateway, owned, attacker) -> None:
    victim = {"Authorization": f"Bearer {owned['key']}"}
    file_id = owned["file"]
    for target in (f"/v1/files/%66{file_id[1:]}", f"/v1/files/{file_id}%2Fcontent", f"/v1%2Ffiles%2F{file_id}"):
        assert raw_request(gateway, "GET", target, headers=victim)[0] == 200, target
        assert raw_request(gateway, "GET", target, headers=attacker)[0] == 404, target


def test_another_tenants_ids_are_not_found_for_it(gateway, owned, attacker, recorded) -> None:
    for method, target in (
        ("GET", f"/v1/files/{owned['file']}"),
        ("GET", f"/v1/files/{owned['file']}/content"),
        ("GET", f"/v1/files/{owned['output']}/content"),
        ("DELETE", f"/v1/files/{owned['file']}"),
        ("GET", f"/v1/batches/{owned['batch']}"),
        ("POST", f"/v1/batches/{owned['batch']}/cancel"),
    ):
        status, _, body = raw_request(gateway, method, target, headers=attacker)
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found", (method, target)
    create = json.dumps(
        {"input_file_id": owned["file"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    ).encode()
    status, _, _ = raw_request(
        gateway, "POST", "/v1/batches", headers={**attacker, "Content-Type": "application/json"}, body=create
    )
    assert status == 404
    status, _, body = raw_request(gateway, "GET", "/v1/batches?limit=100", headers=attacker)
    assert status == 200 and owned["batch"].encode() not in body
    victim = {"Authorization": f"Bearer {owned['key']}"}
    assert raw_request(gateway, "GET", f"/v1/files/{owned['file']}/content", headers=victim)[0] == 200
    assert recorded.seen == []


def test_uploads_past_the_cap_are_refused_declared_or_chunked(start_gateway, make_key, recorded) -> None:
    with start_gateway(batch={"max_file_bytes": 2048}) as (api, metrics):
        headers = {"Authorization": f"Bearer {make_key('big-co')}"}
        small, kind = multipart((json.dumps(LINE) + "\n").encode())
        assert raw_request(api, "POST", "/v1/files", headers={**headers, "Content-Type": kind}, body=small)[0] == 200
        big, kind = multipart((json.dumps(LINE) + "\n").encode() * 40)
        status, _, body = raw_request(api, "POST", "/v1/files", headers={**headers, "Content-Type": kind}, body=big)
        assert status == 413 and json.loads(body)["error"]["code"] == "file_too_large"
        # Chunked: no Content-Length to refuse on, so the read itself must stop at the cap.
        huge, kind = multipart(b"x" * 5_000_000)
        parts = urlsplit(api)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_BOUND_S)
        try:
            connection.request(
                "POST",
                "/v1/files",
                body=iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)]),
                headers={**headers, "Content-Type": kind, "Transfer-Encoding": "chunked"},
                encode_chunked=True,
            )
            response = connection.getresponse()
            assert response.status == 413
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed before the rest of the body was sent: its own count says how
        finally:
            connection.close()
        # Both oversized uploads were answered 413 by the gateway's own code (a handler that crashed
        # would have answered 500, or nothing), and only the small one is stored.
        answered = httpx.get(f"{metrics}/metrics").text
        assert 'llmstack_gateway_requests_total{model="",status="413",tenant="big-co"} 2.0' in answered, answered
        assert 'status="500"' not in answered
        listed = json.loads(raw_request(api, "GET", "/v1/files", headers=headers)[2])
        assert len(listed["data"]) == 1
    assert recorded.seen == []


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not utf-8\n",
        b'[{"custom_id": "a"}]\n',
        b"just text\n",
        b"",
        b"\n\n",
        b'{"custom_id": "a"}\n' + b"[" * 5000 + b"]" * 5000 + b"\n",
        b'{"a": NaN}\n',
        b'{"a": 1, "a": 2}\n',
    ],
    ids=["not-utf8", "array", "text", "empty", "blank", "depth-bomb", "nan", "duplicate-key"],
)
def test_uploads_that_are_not_jsonl_are_refused(gateway, attacker, content) -> None:
    body, kind = multipart(content)
    status, _, answer = raw_request(gateway, "POST", "/v1/files", headers={**attacker, "Content-Type": kind}, body=body)
    assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_file_format"


def test_malformed_upload_forms_are_refused(gateway, attacker) -> None:
    line = (json.dumps(LINE) + "\n").encode()
    for body, kind in (
        multipart(line, purpose="fine-tune"),
        multipart(line, field="document"),
        (line, "application/jsonl"),
        (b"--x\r\ngarbage", "multipart/form-data; boundary=x"),
    ):
        status, _, answer = raw_request(
            gateway, "POST", "/v1/files", headers={**attacker, "Content-Type": kind}, body=body
        )
        assert status == 400, (kind, answer)


@pytest.mark.parametrize(
    "document",
    [
        {
            "input_file_id": "file-000000000000000000000000",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        {"endpoint": "/v1/chat/completions", "completion_window": "24h"},
        {"input_file_id": ["x"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ],
    ids=["unknown-file", "no-file", "file-not-a-string"],
)
def test_batches_of_files_that_do_not_exist_are_not_found(gateway, attacker, document) -> None:
    status, _, _ = raw_request(
        gateway,
        "POST",
        "/v1/batches",
        headers={**attacker, "Content-Type": "application/json"},
        body=json.dumps(document).encode(),
    )
    assert status == 404


def test_create_refuses_what_openai_would(gateway, owned) -> None:
    victim = {"Authorization": f"Bearer {owned['key']}", "Content-Type": "application/json"}
    good = {"input_file_id": owned["file"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for change, param in (
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"endpoint": "/v1/models"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"priority": 0}, "priority"),
        ({"metadata": {str(n): "v" for n in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
    ):
        status, _, body = raw_request(
            gateway, "POST", "/v1/batches", headers=victim, body=json.dumps({**good, **change}).encode()
        )
        assert status == 400 and json.loads(body)["error"]["param"] == param, change
    output_as_input = {**good, "input_file_id": owned["output"]}
    status, _, _ = raw_request(
        gateway, "POST", "/v1/batches", headers=victim, body=json.dumps(output_as_input).encode()
    )
    assert status == 404  # results are not batch input
    # Every spelling a lax parser reads as a number: a clear 400, never a 500 or a huge page.
    lax_limits = (
        "0",
        "abc",
        "-1",
        "+5",
        "%2B5",
        "%205",
        "5%20",
        "1e2",
        "5.0",
        "0x10",
        "%C2%B2",
        "%D9%A3",
        "9" * 5000,
        "",
    )
    for target in (
        "/v1/batches?limit=101",
        *(f"/v1/batches?limit={v}" for v in lax_limits),
        "/v1/files?limit=10001",
        *(f"/v1/files?limit={v}" for v in lax_limits),
        "/v1/files?order=sideways",
        "/v1/files?order=DESC",
    ):
        assert raw_request(gateway, "GET", target, headers=victim)[0] == 400, target


def test_methods_outside_the_allowlist_get_405(gateway, owned) -> None:
    victim = {"Authorization": f"Bearer {owned['key']}"}
    for method, target, allow in (
        ("PUT", "/v1/files", "GET, POST"),
        ("DELETE", f"/v1/batches/{owned['batch']}", "GET"),
        ("GET", f"/v1/batches/{owned['batch']}/cancel", "POST"),
        ("PATCH", "/v1/batches", "GET, POST"),
    ):
        status, headers, _ = raw_request(gateway, method, target, headers=victim)
        assert (status, headers.get("allow")) == (405, allow), (method, target)


def test_uploads_and_polling_count_against_the_keys_rate_limit(gateway, redis_server) -> None:
    from serving.gateway.auth.keys import create_key_sync
    from tests.support.gateway import GENEROUS

    key = create_key_sync(redis_server.url, "flooder-co", "batch", limits={**GENEROUS, "requests_per_minute": 3})
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    client.files.create(file=("in.jsonl", (json.dumps(LINE) + "\n").encode()), purpose="batch")
    client.files.list()
    client.batches.list()
    with pytest.raises(openai.RateLimitError) as refused:
        client.files.create(file=("more.jsonl", (json.dumps(LINE) + "\n").encode()), purpose="batch")
    assert refused.value.response.headers.get("retry-after")
    owner = create_key_sync(redis_server.url, "flooder-co", "reader", limits=GENEROUS)
    reader = openai.OpenAI(base_url=f"{gateway}/v1", api_key=owner, max_retries=0, timeout=HANG_BOUND_S)
    assert [f.filename for f in reader.files.list()] == ["in.jsonl"]  # the refused upload stored nothing


def test_a_held_open_upload_holds_one_of_the_keys_concurrent_slots(gateway, redis_server) -> None:
    import time

    import redis

    from serving.gateway.auth.keys import create_key_sync
    from serving.gateway.limits.tenants import counter_keys
    from tests.support.gateway import GENEROUS

    key = create_key_sync(redis_server.url, "slowpoke-co", "batch", limits={**GENEROUS, "max_concurrent_requests": 1})
    body, content_type = multipart((json.dumps(LINE) + "\n").encode())
    parts = urlsplit(gateway)
    slow = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_BOUND_S)
    slow.putrequest("POST", "/v1/files")
    for name, value in (
        ("Authorization", f"Bearer {key}"),
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
    ):
        slow.putheader(name, value)
    slow.endheaders()
    slow.send(body[:10])  # and hold the rest
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    in_flight = redis.Redis.from_url(redis_server.url)
    try:
        # The upload holds its slot once the gateway has read its headers (the tenant's in-flight
        # set shows it); only then may the probe go, or the probe could be the one holding it.
        deadline = time.monotonic() + HANG_BOUND_S
        while in_flight.zcard(counter_keys("slowpoke-co", "-")[6]) != 1:
            assert time.monotonic() < deadline, "the held upload never took a slot"
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            client.files.list()
        assert "concurrent" in refused.value.message, refused.value.message
        slow.send(body[10:])
        assert slow.getresponse().status == 200
    finally:
        slow.close()
        in_flight.close()
    assert len(client.files.list().data) == 1  # the slot came back with the upload's end


def test_a_held_open_upload_does_not_hold_other_tenants_uploads(gateway, make_key, redis_server) -> None:
    # The slow client sends its headers and part of its body, then holds the rest. Another
    # tenant's upload (read, parsed, checked, stored) must complete while it is still open: a
    # process-wide lock taken before the body is read made every other upload wait behind it.
    import select
    import threading
    import time

    import redis

    from serving.gateway.limits.tenants import counter_keys

    body, content_type = multipart((json.dumps(LINE) + "\n").encode() * 50)
    parts = urlsplit(gateway)
    slow = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_BOUND_S)
    slow.putrequest("POST", "/v1/files")
    for name, value in (
        ("Authorization", f"Bearer {make_key('slow-uploader-co')}"),
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
    ):
        slow.putheader(name, value)
    slow.endheaders()
    slow.send(body[:100])
    in_flight = redis.Redis.from_url(redis_server.url)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key("prompt-co"), max_retries=0, timeout=HANG_BOUND_S)
    events: list[str] = []
    finished = threading.Event()

    def upload() -> None:
        try:
            client.files.create(file=("b.jsonl", (json.dumps(LINE) + "\n").encode()), purpose="batch")
            events.append("B uploaded")
            # A has no answer yet (the gateway answers a body that stalls too long with 408: a
            # lock held by A would let B in only then).
            answered = select.select([slow.sock], [], [], 0)[0]
            events.append("A answered" if answered else "A still open")
        except Exception as exc:  # kept for the assertion below, whatever it is
            events.append(f"B failed: {exc!r}")
        finally:
            finished.set()

    try:
        deadline = time.monotonic() + HANG_BOUND_S
        while in_flight.zcard(counter_keys("slow-uploader-co", "-")[6]) != 1:  # A is inside the handler
            assert time.monotonic() < deadline, "the held upload never reached the gateway"
            time.sleep(0.01)
        thread = threading.Thread(target=upload, daemon=True)
        thread.start()
        finished.wait(HANG_BOUND_S)  # a hang bound only: on a process-wide lock B waits for A forever
        events.append("A released")
        assert events == ["B uploaded", "A still open", "A released"]
        slow.send(body[100:])
        assert slow.getresponse().status == 200  # and A's upload, held all along, completes too
        thread.join(HANG_BOUND_S)
    finally:
        slow.close()
        in_flight.close()


def test_slow_downloads_hold_a_chunk_each_not_the_file(start_gateway, make_key) -> None:
    # Readers that take a file's headers and then stop reading: each download must hold one
    # chunk of the Batch API's memory while it waits to send it, never the whole file, or a few
    # slow readers of a large file hold many copies of it. Counted by the gateway's own gauge.
    import socket
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from serving.gateway.config.batch_policy import DOWNLOAD_CHUNK_BYTES

    def held(metrics: str) -> float:
        text = httpx.get(f"{metrics}/metrics").text
        return next(
            (
                s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "llmstack_gateway_batch_memory_bytes"
            ),
            -1.0,
        )

    line = {**LINE, "body": {**LINE["body"], "messages": [{"role": "user", "content": "x" * 50_000}]}}
    content = b"".join((json.dumps({**line, "custom_id": f"c{n}"}) + "\n").encode() for n in range(240))
    readers = 4
    with start_gateway() as (api, metrics):
        key = make_key("downloader-co")
        client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        file_id = client.files.create(file=("big.jsonl", content), purpose="batch").id
        parts = urlsplit(api)
        connections = []
        for _ in range(readers):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)  # before connect: a small window
            sock.connect((parts.hostname, parts.port))
            sock.sendall(
                f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
            )
            connections.append(sock)
        heads = []
        for sock in connections:
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1024)
            heads.append(head)
        assert all(b"transfer-encoding: chunked" in h.lower() for h in heads)
        assert all(b"content-length" not in h.lower() for h in heads)  # not built whole to be measured
        # Every reader stopped: the gateway's sends block, each with its chunk taken.
        deadline = time.monotonic() + HANG_BOUND_S
        while held(metrics) < readers * DOWNLOAD_CHUNK_BYTES and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled = held(metrics)
        bodies = []
        for sock, head in zip(connections, heads, strict=True):
            response = bytearray(head.split(b"\r\n\r\n", 1)[1])
            sock.settimeout(HANG_BOUND_S)
            while not response.endswith(b"0\r\n\r\n"):
                response += sock.recv(1 << 20)
            sock.close()
            bodies.append(bytes(response))
        deadline = time.monotonic() + HANG_BOUND_S
        while held(metrics) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = held(metrics)
    assert len(content) > 10_000_000
    assert stalled == readers * DOWNLOAD_CHUNK_BYTES  # one chunk each: not 0 (counted), not the file
    assert after == 0
    for body in bodies:  # and each reader got the whole file, byte for byte
        assert _dechunk(body) == content


def _dechunk(body: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        at = end + 2 + size + 2
