"""`python -m serving.gateway` as its own OS process, as a pod runs it: settings from the
environment, output to a log file, SIGTERM (then SIGKILL) on the way out however the test ends.
The one way the tests start the gateway as a process; in-process gateways (a thread serving the
same apps) come from tests.support.gateway and tests.support.openai_fakes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ops.harness.processes import background, wait_for_http
from tests.support.servers import HANG_BOUND_S


@contextmanager
def gateway_process(env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen]:
    """The gateway with `env` over this process's environment and `args` (e.g. `--dev-key-file`)."""
    with background([sys.executable, "-m", "serving.gateway", *args], log, env) as process:
        yield process


def wait_answering(url: str, process: subprocess.Popen, status: int = 200) -> httpx.Response:
    """The first answer of `url` with `status`; fails if the process exits first."""
    return wait_for_http(url, process, HANG_BOUND_S, ok=lambda response: response.status_code == status)
