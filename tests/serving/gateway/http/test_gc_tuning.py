"""The gateway process, once started, has frozen its startup heap and collects its youngest GC
generation at the configured threshold (serving.gateway.http.gc_tuning): `python -m
serving.gateway` run as the pod runs it, with one thread beside it that reads the collector's
state once the API answers."""

from __future__ import annotations

import json
import sys
import time

import pytest

from ops.harness.processes import background, free_port
from ops.harness.stub_gateway import gateway_env
from tests.support.gateway_process import wait_answering
from tests.support.servers import HANG_BOUND_S

pytestmark = pytest.mark.slow  # starts a gateway process

# `python -m serving.gateway`, plus a thread that writes gc's state to argv[2] once argv[1] answers.
REPORTING_GATEWAY = """
import gc, json, os, runpy, sys, threading, time
import httpx

url, report = sys.argv[1], sys.argv[2]

def write_report():
    while True:
        try:
            httpx.get(url, timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    state = {"frozen": gc.get_freeze_count(), "threshold": list(gc.get_threshold())}
    with open(report + ".part", "w") as file:
        json.dump(state, file)
    os.replace(report + ".part", report)

threading.Thread(target=write_report, daemon=True).start()
sys.argv = [sys.argv[0]]
runpy.run_module("serving.gateway", run_name="__main__", alter_sys=True)
"""


def test_started_gateway_has_frozen_its_startup_heap_and_uses_the_gen0_threshold(tmp_path):
    port = free_port()
    # Upstream never called; no Redis.
    env = gateway_env(upstream="http://127.0.0.1:9", redis_url="", port=port, settings={"gc_gen0_threshold": 12_345})
    healthz = f"http://127.0.0.1:{port}/healthz"
    report = tmp_path / "gc.json"
    args = [sys.executable, "-c", REPORTING_GATEWAY, healthz, str(report)]
    with background(args, tmp_path / "gateway.log", env) as process:
        wait_answering(healthz, process)
        deadline = time.monotonic() + HANG_BOUND_S
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        state = json.loads(report.read_text())
    # The imports alone are tens of thousands of objects: the heap was frozen, not a handful.
    assert state["frozen"] > 10_000
    assert state["threshold"][0] == 12_345
