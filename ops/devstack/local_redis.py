"""A private `redis-server` for `make dev` and the tests: loopback only, free port, no disk.

Each caller gets its own server on 127.0.0.1 with persistence off and its files in a
temporary folder, and stops exactly the process it started. It runs with the gateway's
required `maxmemory-policy` (noeviction, as in the cluster), so a full Redis refuses writes
instead of deleting budgets; `maxmemory` sets a size (tests), `policy` another policy (a test
showing what eviction would do).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ops.harness.processes import die_with_parent, free_port, terminate
from serving.gateway.telemetry.redis_memory import REQUIRED_POLICY


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


@dataclass
class LocalRedis:
    process: subprocess.Popen[bytes]
    port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        terminate(self.process, grace_s=10)
        shutil.rmtree(self.folder, ignore_errors=True)


def start_redis(
    port: int | None = None,
    *,
    timeout_s: float = 10,
    load: Path | None = None,
    maxmemory: str | None = None,
    policy: str = REQUIRED_POLICY,
) -> LocalRedis:
    """Start redis-server and wait until it accepts connections. `load`: an RDB snapshot
    (from SAVE) to start with, as a restarted or failed-over Redis would have its data.
    `maxmemory`: e.g. "16mb" (default: no limit, the machine's memory)."""
    binary = redis_server_path()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (Debian/Ubuntu: apt-get install -y redis-server)")
    port = port or free_port()
    folder = Path(tempfile.mkdtemp(prefix="llmstack-redis-"))
    if load is not None:
        shutil.copyfile(load, folder / "dump.rdb")  # read at start; `--save ""` never writes it back
    process = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
            "--protected-mode",
            "yes",
            "--maxmemory-policy",
            policy,
            *(["--maxmemory", maxmemory] if maxmemory else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    server = LocalRedis(process, port, folder)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"redis-server exited with {process.returncode} (port {port} busy?)")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"redis-server did not answer on port {port} within {timeout_s} s")


@contextmanager
def running_redis(*, maxmemory: str | None = None, policy: str = REQUIRED_POLICY) -> Iterator[LocalRedis]:
    server = start_redis(maxmemory=maxmemory, policy=policy)
    try:
        yield server
    finally:
        server.stop()
