"""PortClaims: a claimed port is kept from everyone but the server it is meant for."""

from __future__ import annotations

import socket

import pytest
import uvicorn

from ops.harness.processes import PortClaims


@pytest.fixture
def claims():
    held = PortClaims()
    yield held
    held.release()


def test_the_kernel_hands_a_claimed_port_to_no_one_else(claims):
    port = claims.claim()
    # Many binds to port 0: the kernel's choice for a client socket or a random server port.
    sockets = [socket.socket() for _ in range(2000)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        assert port not in {sock.getsockname()[1] for sock in sockets}
    finally:
        for sock in sockets:
            sock.close()


def test_a_server_that_reuses_addresses_listens_on_a_claimed_port(claims):
    port = claims.claim()
    server = uvicorn.Config(app=None, host="127.0.0.1", port=port).bind_socket()  # SO_REUSEADDR, as uvicorn binds
    try:
        server.listen()  # what uvicorn's serve() does with the bound socket
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        server.close()


def test_a_port_another_program_listens_on_cannot_be_claimed(claims):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            claims.claim(other.getsockname()[1])


def test_release_gives_the_port_back(claims):
    port = claims.claim()
    claims.release()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: fails if anything still holds it
