"""Helper processes for `make dev`, benchmarks and tests: a free port, start one process with
its output in a log file, wait until it answers HTTP, and stop it (SIGTERM, then SIGKILL)
however the caller exits. The one place these steps are written."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx

from infra.spec.stack_file import PROJECT_ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortClaims:
    """Ports held for servers this process starts later. A port picked now and bound minutes
    later (after Ray starts) can meanwhile become the local end of someone's outgoing
    connection and fail the bind. A socket bound here with SO_REUSEADDR, never listening,
    keeps the kernel from handing the port out, yet lets the server (uvicorn, HAProxy, aiohttp
    and redis-server all set SO_REUSEADDR) bind and listen on it. `release()` once they listen."""

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []

    def claim(self, port: int = 0) -> int:
        """Hold `port` (0: a free one) on 127.0.0.1 and return it; OSError if it is taken."""
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        self._sockets.append(sock)
        return sock.getsockname()[1]

    def release(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


def die_with_parent() -> None:
    """Run in a child before exec (Linux): deliver SIGTERM to it when its parent dies, so a
    `make dev` killed with SIGKILL does not leave servers behind."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate(process: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM `process`, wait up to `grace_s`, then SIGKILL. A no-op once it has exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


def stop_tree(process: subprocess.Popen, grace_s: float, say: Callable[[str], None] = print) -> None:
    """SIGTERM `process` (leader of its own session), wait, then SIGKILL whatever is left of
    its group and descendants: an orphaned vLLM engine core or Ray worker would keep the
    cores busy long after the run it belonged to."""
    import psutil

    try:  # psutil.Process objects refuse to signal a pid that was reused meanwhile
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # leader still alive: its pid is still our group's id
            say(f"pid {process.pid} ignored SIGTERM for {grace_s:.0f} s; killing its process group")
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    # Leftovers by id: descendants seen at the start, and members of the session's group that
    # an early exit of the leader had already orphaned (reparented, so not in `tree`).
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == process.pid]
    for leftover in {*tree, *group}:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@contextmanager
def background(
    args: list[str], log: Path, env: dict[str, str] | None = None, *, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    """`args` running from the repository root (or `cwd`: another checkout, whose packages a
    `python -m` then imports), stdout and stderr to `log`."""
    with log.open("w") as out:
        process = subprocess.Popen(
            args, cwd=cwd or PROJECT_ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        terminate(process)


def wait_for_http(
    url: str,
    process: subprocess.Popen,
    timeout_s: float = 120,
    *,
    ok: Callable[[httpx.Response], bool] = lambda response: True,
) -> httpx.Response:
    """Return the first answer from `url` that `ok` accepts (by default any HTTP answer);
    fail if `process` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            argv = cast(list[str], process.args)  # we start processes from argv lists, never a shell string
            raise RuntimeError(f"{argv[:3]} exited with {process.returncode} before answering {url}")
        try:
            response = httpx.get(url, timeout=2)
            if ok(response):
                return response
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")
