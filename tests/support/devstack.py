"""`make dev` as the end-to-end tests run it: `python -m ops.devstack --ready-json` in its own
session and state folder, ready once it prints its ready line; stopped with SIGTERM. Also what
the tests read from a running one: what its engines report, and Ray calls made from a child
process (the test process itself stays Ray-free)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port

# vLLM's own line once it has sized the cache (vllm/v1/core/kv_cache_utils.py, update_kv_cache_capacity)
KV_CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
# Ray writes the actor's name at the top of each worker's log (ray/_private/log_monitor.py reads it back)
ACTOR_NAME_LINE = re.compile(r"^:actor_name:ServeReplica:[^:]+:LLMServer:(.+)$", re.MULTILINE)

SCALE_TO_ZERO_MODEL = "tiny-chat-ngram"
# What the scale-from-zero test needs of its model: Serve takes it to zero 5 s after its last
# request, and 4 requests fill its one replica, so a burst of 6 first requests waits in the
# gateway's queue. Read by the gateway at start (its queue's per-replica capacity).
SCALE_TO_ZERO_AUTOSCALING = {
    "max_ongoing_requests": 4,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 5,
}


def e2e_stack_text(local_stack_text: str) -> str:
    """The end-to-end tests' shared stack: Pulumi.local.yaml with 8 logical CPUs instead of 6, so a
    second tiny-chat replica fits beside the others for the live scale-up; the gateway resuming
    streams whose replica dies (`gateway.stream_resume`, for tests/e2e/test_stream_resume_live.py);
    and SCALE_TO_ZERO_AUTOSCALING on tiny-chat-ngram, still at one replica until a test scales it."""
    from ops.llmctl.scale.stack_edit import set_model_autoscaling

    assert "cpus_per_node: 6" in local_stack_text and "  llmstack:gateway:\n" in local_stack_text
    text = local_stack_text.replace("cpus_per_node: 6", "cpus_per_node: 8")
    if "stream_resume:" not in text:
        text = text.replace("  llmstack:gateway:\n", "  llmstack:gateway:\n    stream_resume: {enabled: true}\n", 1)
    return set_model_autoscaling(
        text,
        file_label="Pulumi.local.yaml",
        model_id=SCALE_TO_ZERO_MODEL,
        changes=SCALE_TO_ZERO_AUTOSCALING,
    )


class DevStack:
    """`trace`: as `make dev TRACE=1`, every request's spans in `spans_file` (ops.devstack.trace_collector)."""

    def __init__(self, stack: str = "local", env: dict[str, str] | None = None, *, trace: bool = False) -> None:
        self.state_dir = tempfile.mkdtemp(prefix="llmstack-dev-state-")
        self.env = {**os.environ, **(env or {}), "LLMSTACK_STATE_DIR": self.state_dir}
        self.port = free_port()
        self.spans_file = Path(self.state_dir) / "traces.jsonl"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.devstack", "--stack", stack, "--port", str(self.port), "--ready-json"]
            + (["--trace"] if trace else []),
            cwd=PROJECT_ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
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

    def alive_descendants(self) -> list[int]:
        """Processes it had started once ready that still run (zombies excluded)."""
        alive = []
        for pid in self.descendants:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def ray_session_dir(self) -> Path:
        """Its Ray session folder, from its raylet's command line (`--session_dir=`)."""
        for pid in self.descendants:
            try:
                process = psutil.Process(pid)
                if process.name() == "raylet":
                    for arg in process.cmdline():
                        if arg.startswith("--session_dir="):
                            return Path(arg.removeprefix("--session_dir="))
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError("no raylet among the dev stack's processes")

    def engine_kv_tokens(self) -> dict[str, set[int]]:
        """Model -> the KV cache sizes (tokens) its running engines reported when they sized the
        cache, read from each Serve replica worker's log (one entry per replica)."""
        found: dict[str, set[int]] = {}
        for log in (self.ray_session_dir() / "logs").glob("worker-*.*"):  # vLLM logs to .out or .err
            text = log.read_text(errors="replace")
            actor, size = ACTOR_NAME_LINE.search(text), KV_CACHE_LINE.search(text)
            if actor and size:
                found.setdefault(actor.group(1), set()).add(int(size.group(1).replace(",", "")))
        return found

    def llmctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`llmctl ARGS` as a user beside this stack runs it (its state folder: its lock record)."""
        return subprocess.run(
            [str(Path(sys.executable).parent / "llmctl"), *args],
            capture_output=True,
            text=True,
            cwd=PROJECT_ROOT,
            env=self.env,
            timeout=900,
        )

    def ray_call(self, code: str, timeout_s: float = 300) -> str:
        """Run `code` in a child process joined to this stack's Ray (as `llmctl scale` joins it;
        `dev` is its lock record); returns the child's last line of output."""
        prelude = (
            "from ops.devstack.lock import find_running_dev; from ops.devstack import serve as local_serve; "
            "dev = find_running_dev(); local_serve.connect(dev.ray_address, dev.ray_auth_mode)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", prelude + code],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=PROJECT_ROOT,
            timeout=timeout_s,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]
