"""Bounded work before admission, at the transport: a request must arrive whole within the body
deadline (a slow sender gets 408 instead of holding its connection and partial body forever),
and past `max_connections` a new request gets 503 before it costs anything. Raw sockets
against a real gateway, run as `python -m serving.gateway` runs it (serving.gateway.server).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack
from urllib.parse import urlsplit

import httpx

from tests.support.servers import HANG_BOUND_S


def connect(base_url: str) -> socket.socket:
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=HANG_BOUND_S)
    return sock


def start_post(sock: socket.socket, key: str, length: int, first: bytes) -> None:
    """Headers promising `length` body bytes, then only `first`."""
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode() + first)


def status_of(sock: socket.socket) -> int:
    """The status of the response on `sock`; raises socket.timeout if none comes (a hang)."""
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed without a response (got {head!r})")
        head += chunk
    return int(head.split(b" ", 2)[1])


def test_a_stalled_body_gets_408_at_the_deadline(start_gateway, recorded, key):
    with start_gateway(body_timeout_s=0.5) as (gateway, _), connect(gateway) as sock:
        start_post(sock, key, 10_000, b'{"model": "tiny", "messages": [')  # and then nothing
        assert status_of(sock) == 408  # the old gateway waited here until the client gave up
    assert recorded.seen == []


def test_a_trickled_body_gets_408_though_every_byte_is_on_time(start_gateway, recorded, key):
    """A deadline for the whole body, not an idle timeout between reads: one byte every 50 ms
    never leaves the connection idle for long."""
    with start_gateway(body_timeout_s=0.5) as (gateway, _), connect(gateway) as sock:
        start_post(sock, key, 10_000, b"{")
        stop = threading.Event()

        def trickle() -> None:
            deadline = time.monotonic() + HANG_BOUND_S
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    sock.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.05)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            assert status_of(sock) == 408
        finally:
            stop.set()
            sender.join(HANG_BOUND_S)
    assert recorded.seen == []


def test_a_whole_body_in_time_is_served(start_gateway, recorded, key):
    with start_gateway(body_timeout_s=5) as (gateway, _):
        response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and len(recorded.seen) == 1


def test_connections_past_the_cap_get_503_and_cost_nothing(start_gateway, recorded, key):
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with start_gateway(max_connections=3, body_timeout_s=HANG_BOUND_S) as (gateway, _), ExitStack() as held:
        for _ in range(3):  # three slow uploads hold every connection the gateway serves
            start_post(held.enter_context(connect(gateway)), key, 10_000, b"{")
        time.sleep(0.2)  # let the server register them (no timing is asserted)
        refused = httpx.post(f"{gateway}/v1/chat/completions", headers=auth, json=body, timeout=HANG_BOUND_S)
        assert refused.status_code == 503  # the old gateway took every connection it was offered
        held.close()
        deadline = time.monotonic() + HANG_BOUND_S
        while (served := httpx.post(f"{gateway}/v1/chat/completions", headers=auth, json=body,
                                    timeout=HANG_BOUND_S)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the closed sockets on its next loop turns
        assert served.status_code == 200
    assert len(recorded.seen) == 1  # only the one served after the slow ones left
