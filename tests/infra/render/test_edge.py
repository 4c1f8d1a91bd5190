"""The edge's HAProxy configuration (infra.render.edge): HAProxy itself accepts what is rendered
for each example stack, in the pod and in `make dev`, with the stack's bounds in it. Its
behaviour under attack is tested through real sockets in tests/serving/gateway/http/test_transport.py."""

from __future__ import annotations

import subprocess

import pytest

from infra.render.edge import CONFIG_FILE, HEADERS_TOO_LARGE_FILE, buffer_bytes, edge_files, edge_memory_mib
from infra.render.gateway import edge_files_for
from infra.spec.schema import Edge
from ops.devstack.edge import haproxy_binary


def haproxy_accepts(files: dict[str, str], directory) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (directory / name).write_text(text)
    return subprocess.run(
        [haproxy_binary(), "-c", "-f", str(directory / CONFIG_FILE)], capture_output=True, text=True, timeout=30
    )


def test_haproxy_accepts_the_pods_config(example_stack, tmp_path):
    files = edge_files_for(example_stack)
    # The pod's paths, moved under tmp_path so HAProxy can open the error file it names.
    files = {name: text.replace("/etc/llmstack/edge", str(tmp_path)) for name, text in files.items()}
    checked = haproxy_accepts(files, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    edge = example_stack.gateway.edge
    config = files[CONFIG_FILE]
    assert f"timeout http-request {round(edge.header_timeout_s * 1000)}ms" in config
    assert f"tune.bufsize {buffer_bytes(edge)}" in config
    assert f"sc0_conn_cur gt {edge.max_connections_per_client}" in config
    assert f"req.hdrs,length gt {edge.max_header_bytes}" in config


@pytest.mark.parametrize(
    "edge",
    [Edge(), Edge(header_timeout_s=0.5, max_header_bytes=4096, max_connections=16, max_connections_per_client=1)],
)
def test_haproxy_accepts_the_local_config_at_the_bounds(edge, tmp_path):
    files = edge_files(
        edge,
        directory=str(tmp_path),
        listen="127.0.0.1:1",
        gateway="127.0.0.1:2",
        health="127.0.0.1:3",
        request_timeout_s=600,
        shutdown_grace_s=90,
        proxy_protocol=False,
    )
    checked = haproxy_accepts(files, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "accept-proxy" not in files[CONFIG_FILE]
    assert '"code": "request_header_fields_too_large"' in files[HEADERS_TOO_LARGE_FILE]


def test_the_edges_memory_limit_grows_with_its_connections():
    assert edge_memory_mib(Edge(max_connections=4096)) > edge_memory_mib(Edge()) * 1.9 - 64
    assert edge_memory_mib(Edge()) * 2**20 >= 2 * buffer_bytes(Edge()) * Edge().max_connections
