"""Bounded work before admission, at the transport: a request must arrive whole within the body
deadline (a slow sender gets 408 instead of holding its connection and partial body forever),
and past `max_connections` a new request gets 503 before it costs anything. Raw sockets
against a real gateway, run as `python -m serving.gateway` runs it (serving.gateway.http.server).

Before any of that, the public port is the edge's (HAProxy, infra.render.edge), as `make dev` and
the rendered pod run it: clients without a key send headers slowly, send nothing, open many
connections or send megabytes of headers. Each attack is run against a real edge process in
front of a real gateway, next to a legitimate client that must still be served. The edge tests
cost about 15 s (HAProxy starts per test, the header deadline is waited out twice).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from infra.spec.schema import Edge
from tests.support.edge import PublicPort, edge_in_front
from tests.support.gateway import gateway_settings, serving_gateway
from tests.support.servers import HANG_BOUND_S


def connect(base_url: str, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` (any 127.x.y.z is this machine: another client address)."""
    parts = urlsplit(base_url)
    return socket.create_connection((parts.hostname, parts.port), timeout=HANG_BOUND_S, source_address=(source, 0))


def start_post(sock: socket.socket, key: str, length: int, first: bytes) -> None:
    """Headers promising `length` body bytes, then only `first`."""
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
        + first
    )


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
        response = httpx.post(
            f"{gateway}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
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
        while (
            served := httpx.post(f"{gateway}/v1/chat/completions", headers=auth, json=body, timeout=HANG_BOUND_S)
        ).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the closed sockets on its next loop turns
        assert served.status_code == 200
    assert len(recorded.seen) == 1  # only the one served after the slow ones left


# --- the public port: the edge in front of the gateway ------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def public_port(start_gateway, tmp_path) -> Callable[..., AbstractContextManager[PublicPort]]:
    """`with public_port(Edge(...), **gateway settings) as edge:` the edge in front of a gateway."""

    @contextmanager
    def run(edge: Edge, **gateway_settings) -> Iterator[PublicPort]:
        with start_gateway(**gateway_settings) as (api, _), edge_in_front(api, edge, tmp_path) as public:
            yield public

    return run


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed `sock` (EOF or reset); reads and drops any answer first."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def trickle(sock: socket.socket, stop: threading.Event, every_s: float) -> None:
    """One header byte every `every_s` until stopped or the server closes the connection."""
    deadline = time.monotonic() + HANG_BOUND_S
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            sock.sendall(b"a")
        except OSError:
            return
        time.sleep(every_s)


def test_headers_sent_a_byte_at_a_time_get_408_at_the_header_deadline(public_port, recorded):
    """The body deadline starts once headers are complete: without a header deadline a sender
    that never finishes its headers holds the connection forever (the old gateway: > 20 s)."""
    with public_port(Edge(header_timeout_s=1)) as edge, connect(edge.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
        stop = threading.Event()
        sender = threading.Thread(target=trickle, args=(sock, stop, 0.2), daemon=True)
        sender.start()
        try:
            assert status_of(sock) == 408  # the old gateway never answered: socket.timeout here
            assert closed_by_server(sock)
        finally:
            stop.set()
            sender.join(HANG_BOUND_S)
    assert recorded.seen == []


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(public_port):
    with public_port(Edge(header_timeout_s=1)) as edge, connect(edge.url) as sock:
        assert closed_by_server(sock)  # the old gateway kept it open: socket.timeout here


def test_a_slow_client_within_the_deadlines_is_served(public_port, recorded, key):
    """The other side of the bound: headers in pieces, well inside the deadline, then the body."""
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with public_port(Edge(header_timeout_s=10)) as edge, connect(edge.url) as sock:
        for start in range(0, len(head), 40):
            sock.sendall(head[start : start + 40])
            time.sleep(0.05)
        sock.sendall(body)
        assert status_of(sock) == 200
    assert len(recorded.seen) == 1


def test_idle_connections_past_the_per_address_cap_are_refused_and_others_are_served(public_port, recorded, key):
    """One address holds its cap of idle connections: its next one is refused at accept, while
    another address (the kubelet's node, another client) still gets /healthz and its answers.
    The gateway's own connection cap (3) is not touched by connections that sent no request."""
    auth = {"Authorization": f"Bearer {key}"}
    with (
        public_port(Edge(max_connections_per_client=3, header_timeout_s=HANG_BOUND_S), max_connections=3) as edge,
        ExitStack() as held,
    ):
        idle = [held.enter_context(connect(edge.url)) for _ in range(3)]
        assert all(sock.fileno() >= 0 for sock in idle)
        try:
            over = held.enter_context(connect(edge.url))
            over.settimeout(HANG_BOUND_S)
            assert closed_by_server(over)  # the old gateway accepted it and kept it open
        except ConnectionResetError:
            pass  # reset while connecting: refused as well
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=HANG_BOUND_S) as other:
            assert other.get(f"{edge.url}/healthz").status_code == 200  # the old gateway: 503
            assert other.post(f"{edge.url}/v1/chat/completions", headers=auth, json=CHAT).status_code == 200
        assert httpx.get(edge.health_url).status_code == 200
    assert len(recorded.seen) == 1


def test_oversized_headers_get_431_and_megabytes_of_them_hold_no_memory(public_port, recorded, key):
    auth = {"Authorization": f"Bearer {key}"}
    with public_port(Edge(max_header_bytes=16_384)) as edge:
        within = httpx.post(
            f"{edge.url}/v1/chat/completions", json=CHAT, timeout=HANG_BOUND_S, headers={**auth, "X-Pad": "a" * 15_000}
        )
        assert within.status_code == 200  # the other side of the bound
        over = httpx.post(
            f"{edge.url}/v1/chat/completions", json=CHAT, timeout=HANG_BOUND_S, headers={**auth, "X-Pad": "a" * 20_000}
        )
        assert over.status_code == 431  # the old gateway served it
        assert over.json()["error"]["code"] == "request_header_fields_too_large"

        process = psutil.Process(edge.process.pid)
        before, peak = process.memory_info().rss, [0]
        taken: list[int] = []
        total, line = 20 * 2**20, b"X-Pad: " + b"a" * 8183 + b"\r\n"

        def flood() -> None:
            sent = 0
            with connect(edge.url) as sock:
                try:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n")
                    while sent < total:
                        sock.sendall(line * 8)
                        sent += len(line) * 8
                except OSError:
                    pass
            taken.append(sent)

        attackers = [threading.Thread(target=flood) for _ in range(4)]
        for attacker in attackers:
            attacker.start()
        while any(a.is_alive() for a in attackers):
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.02)
        assert len(taken) == 4 and max(taken) < total  # the edge stopped reading (the old gateway took 4 x 20 MB)
        assert peak[0] - before < 8 * 2**20  # the old gateway grew by about 84 MB here
    assert len(recorded.seen) == 1


def test_a_stream_flows_through_the_edge_chunk_by_chunk(upstream, redis_server, key, tmp_path):
    """The edge relays a streamed answer as it comes (no buffering), usage included."""
    from openai import OpenAI

    settings = gateway_settings(upstream.url, redis_server.url)
    with serving_gateway(settings) as (api, _), edge_in_front(api, Edge(header_timeout_s=1), tmp_path) as edge:
        client = OpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        stream = client.chat.completions.create(
            model="tiny",
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": '#stub {"id": "edge-stream", "tokens": 6, "per_chunk": 1}'}],
        )
        chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_behind_the_load_balancer_the_cap_counts_the_address_in_the_proxy_header(start_gateway, tmp_path):
    """The pod's config: every connection comes from the NLB, which names the client in a PROXY
    header. The cap must count those clients, not the NLB's own address."""

    def via_nlb(edge: PublicPort, client: str) -> socket.socket:
        sock = connect(edge.url)
        port = urlsplit(edge.url).port
        sock.sendall(f"PROXY TCP4 {client} 127.0.0.1 40000 {port}\r\n".encode())
        return sock

    edge_settings = Edge(max_connections_per_client=2, header_timeout_s=HANG_BOUND_S)
    with (
        start_gateway() as (api, _),
        edge_in_front(api, edge_settings, tmp_path, proxy_protocol=True) as edge,
        ExitStack() as held,
    ):
        for _ in range(2):
            held.enter_context(via_nlb(edge, "203.0.113.7"))
        time.sleep(0.2)  # both sessions registered (no timing is asserted)
        over = held.enter_context(via_nlb(edge, "203.0.113.7"))
        assert closed_by_server(over)  # its third connection: refused
        with via_nlb(edge, "198.51.100.9") as other:  # another client, through the same NLB address
            other.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
            assert status_of(other) == 200
