"""The `make dev` lock: one running dev stack per checkout, and what it serves.

The runner holds an flock on `<state dir>/dev.lock` for as long as it runs and, once the stack
serves, writes its endpoints into the same file; `llmctl keys|status|scale --stack local` read
them from here. A lock left behind by a `make dev` that was killed outright names a process
that no longer exists, so the pid is checked. This module is the file's only reader and writer.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ops.paths import state_dir

LOCK_NAME = "dev.lock"
NOT_RUNNING = (
    "make dev is not running in this checkout (no live lock in {path}); "
    "start it with `make dev`, or set LLMSTACK_STATE_DIR to the one it uses"
)


def lock_path(folder: Path | None = None) -> Path:
    return (folder or state_dir()) / LOCK_NAME


class AlreadyRunning(Exception):
    pass


class RunningDev(BaseModel):
    pid: int = Field(description="The `make dev` process.")
    stack: str = Field(default="local", description="Stack it runs.")
    base_url: str = Field(description="Gateway base URL, ending in /v1.")
    metrics_url: str | None = Field(default=None, description="The gateway's metrics port: /readyz and /metrics.")
    redis_url: str | None = Field(default=None, description="Its private redis-server; None: in-memory store.")
    ray_address: str | None = Field(default=None, description="GCS address of its Ray.")
    ray_auth_mode: str | None = Field(default=None, description="RAY_AUTH_MODE a client must use.")
    serve_port: int | None = Field(default=None, description="Ray Serve's HTTP port.")
    dashboard_url: str | None = Field(default=None, description="Its Ray dashboard (REST API), on loopback.")
    serving_path: str | None = Field(default=None, description="Serving path it deployed; None: the default.")
    trace_endpoint: str | None = Field(
        default=None,
        description="The local trace receiver `make dev TRACE=1` sends to (not in the stack file): a live "
        "`llmctl scale` renders with it, or the engines would restart without their tracing.",
    )

    @property
    def gateway_root(self) -> str:
        return self.base_url.removesuffix("/v1")


class DevLock:
    """Held by the running `make dev`: an flock on the lock file, which also says who holds it."""

    def __init__(self, folder: Path | None = None) -> None:
        self.path = lock_path(folder)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+")

    def acquire(self) -> None:
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "{}"
            info = json.loads(holder) if holder.startswith("{") else {}
            raise AlreadyRunning(
                f"llmstack dev is already running (pid {info.get('pid', '?')}, gateway at "
                f"{info.get('base_url', '?')}); stop it with Ctrl-C in its terminal or "
                f"`kill {info.get('pid', '<pid>')}`"
            ) from None

    def record(self, **info: Any) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({"pid": os.getpid(), **info}))
        self._file.flush()

    def release(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def parse_lock(text: str | None, pid_alive=lambda pid: _pid_alive(pid)) -> RunningDev | None:
    """The running dev stack a lock file's text describes, or None (empty, still starting,
    or left behind by a process that is gone). Pure but for `pid_alive`."""
    if not text or not text.startswith("{"):
        return None
    info = json.loads(text)
    if "base_url" not in info or not pid_alive(int(info.get("pid", 0))):
        return None
    return RunningDev.model_validate(info)


def find_running_dev(folder: Path | None = None) -> RunningDev | None:
    lock = lock_path(folder)
    return parse_lock(lock.read_text() if lock.is_file() else None)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
