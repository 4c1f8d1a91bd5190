"""`make dev` as the end-to-end tests run it: `python -m ops.devstack --ready-json` in its own
session and state folder, ready once it prints its ready line; stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

import psutil

from infra.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port


class DevStack:
    def __init__(self, stack: str = "local", env: dict[str, str] | None = None) -> None:
        self.state_dir = tempfile.mkdtemp(prefix="llmstack-dev-state-")
        self.env = {**os.environ, **(env or {}), "LLMSTACK_STATE_DIR": self.state_dir}
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.devstack", "--stack", stack, "--port", str(self.port), "--ready-json"],
            cwd=PROJECT_ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.ready = self._wait_ready()
        self.descendants = {p.pid for p in psutil.Process(self.process.pid).children(recursive=True)}

    def _drain_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line)

    def _wait_ready(self) -> dict:
        # Bounded by pytest's overall run: ops.devstack itself fails (non-zero exit) on any start error.
        for line in self.process.stdout:
            if line.startswith("{") and '"ready"' in line:
                threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()
                return json.loads(line)
        raise RuntimeError("ops.devstack exited before it was ready:\n" + "".join(self.stderr[-50:]))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                raise
        return self.process.returncode
