"""The `make dev` running in this checkout, as its lock file describes it.

`make dev` writes its endpoints into its lock file once the stack serves (see `ops.dev`);
`llmctl status|scale --stack local` read them from there. A lock left behind by a `make
dev` that was killed outright names a process that no longer exists, so the pid is checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, Field


class RunningDev(BaseModel):
    pid: int = Field(description="The `make dev` process.")
    stack: str = Field(default="local", description="Stack it runs.")
    base_url: str = Field(description="Gateway base URL, ending in /v1.")
    metrics_url: str | None = Field(default=None, description="The gateway's metrics port: /readyz and /metrics.")
    redis_url: str | None = Field(default=None, description="Its private redis-server; None: in-memory store.")
    ray_address: str | None = Field(default=None, description="GCS address of its Ray.")
    ray_auth_mode: str | None = Field(default=None, description="RAY_AUTH_MODE a client must use.")
    serve_port: int | None = Field(default=None, description="Ray Serve's HTTP port.")

    @property
    def gateway_root(self) -> str:
        return self.base_url.removesuffix("/v1")


def parse_lock(text: str | None, pid_alive=lambda pid: _pid_alive(pid)) -> RunningDev | None:
    """The running dev stack a lock file's text describes, or None (empty, still starting,
    or left behind by a process that is gone). Pure but for `pid_alive`."""
    if not text or not text.startswith("{"):
        return None
    info = json.loads(text)
    if "base_url" not in info or not pid_alive(int(info.get("pid", 0))):
        return None
    return RunningDev.model_validate(info)


def find_running_dev(state_dir: Path | None = None) -> RunningDev | None:
    from ops.dev import STATE_DIR

    lock = (state_dir or STATE_DIR) / "dev.lock"
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


NOT_RUNNING = ("make dev is not running in this checkout (no live lock in {path}); "
               "start it with `make dev`, or set LLMSTACK_STATE_DIR to the one it uses")
