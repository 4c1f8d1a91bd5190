"""Processes a test run left behind. The root conftest tags the run with a fresh id in the
environment; every process started under it inherits the tag, including those that leave our
process tree on purpose (Ray's raylet, GCS and workers, HAProxy and vLLM engines start in sessions
of their own), so one look at every process's environment finds exactly this run's leftovers."""

from __future__ import annotations

import os
import time

import psutil

RUN_TAG = "LLMSTACK_TEST_RUN"
GRACE_S = 30  # servers stopped by the last tests may still be exiting; only bounds the wait


def _tagged(run_id: str) -> dict[int, str]:
    found = {}
    for process in psutil.process_iter(["pid", "name", "status"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if process.environ().get(RUN_TAG) == run_id:
                found[process.pid] = f"pid {process.pid} {' '.join(process.cmdline())[:160]}"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def left_running(run_id: str, grace_s: float = GRACE_S) -> dict[int, str]:
    """pid -> description of every live process tagged with `run_id`, after waiting up to
    `grace_s` for them to exit."""
    deadline = time.monotonic() + grace_s
    while (found := _tagged(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def stop_leftovers(leftovers: dict[int, str]) -> None:
    """Kill them, so that one failed run does not burden the next."""
    processes = []
    for pid in leftovers:
        try:
            process = psutil.Process(pid)
            process.kill()
            processes.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)
