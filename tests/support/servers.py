"""An ASGI app under a real uvicorn server on 127.0.0.1, in a thread, always stopped: how the
gateway tests run the gateway and its fake upstreams in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from ops.harness.processes import free_port

HANG_BOUND_S = 30  # only bounds a hang; never an assertion about speed


@contextmanager
def serving(app, port: int | None = None, keep_alive_s: int = 5) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 in a thread; always stop it. `keep_alive_s`: how long
    uvicorn keeps an idle connection open (its `timeout_keep_alive`, 5 s by default)."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=keep_alive_s,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_BOUND_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(HANG_BOUND_S)
    fail_if_running(thread, f"uvicorn on port {port}")


def fail_if_running(thread: threading.Thread, what: str) -> None:
    """After a server's thread was asked to stop and joined for HANG_BOUND_S: one still running
    hangs in its shutdown, and whatever it runs (a gateway's batch loops) would outlive the test
    and the redis-server it uses. Said here, by the test that started it, not as log lines later."""
    if thread.is_alive():
        raise RuntimeError(f"{what} did not stop within {HANG_BOUND_S} s: its shutdown hangs")
