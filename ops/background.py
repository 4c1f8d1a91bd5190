"""Helper processes for benchmarks and tests: start one with its output in a log file, wait
until it answers HTTP, and stop it (SIGTERM, then SIGKILL) however the caller exits."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def background(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`args` running from the repository root, stdout and stderr to `log`."""
    with log.open("w") as out:
        process = subprocess.Popen(args, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()  # a no-op when it has exited already
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Return once `url` answers anything over HTTP; fail if `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:3]} exited with {process.returncode} before answering")
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")
