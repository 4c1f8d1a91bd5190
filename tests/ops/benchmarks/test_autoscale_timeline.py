"""The autoscaling demo's findings, on a hand-made timeline: load starts at 10 s, a second
replica is made at 16 s and runs at 60 s, one is killed at 80 s, Serve notices at 82 s and
runs two again at 130 s; load stops at 150 s, one replica stops at 170 s and is gone at 190 s."""

from __future__ import annotations

from ops.benchmarks.autoscale_demo import is_replica_title, ray_start_command
from ops.benchmarks.autoscale_timeline import Sample, changes, findings
from ops.llmctl.bench.stats import RequestResult


def _states(t: float) -> dict[str, int]:
    if t < 16:
        return {"RUNNING": 1}
    if t < 60:
        return {"RUNNING": 1, "STARTING": 1}
    if t < 82:
        return {"RUNNING": 2}
    if t < 130:
        return {"RUNNING": 1, "STARTING": 1}
    if t < 170:
        return {"RUNNING": 2}
    if t < 190:
        return {"RUNNING": 1, "STOPPING": 1}
    return {"RUNNING": 1}


SAMPLES = [Sample(t=float(t), states=_states(t)) for t in range(0, 200)]


def _request(start: float, end: float, error: str | None = None) -> RequestResult:
    return RequestResult(start=start, end=end, error=error)


def test_findings():
    results = [_request(s, s + 1) for s in range(10, 150)]
    results += [
        _request(79, 80.2, "APIError"),
        _request(79.5, 80.5, "APIError"),
        _request(80.1, 84, "InternalServerError (500)"),
    ]
    f = findings(SAMPLES, results, load_start=10, kill_at=80, load_stop=150)
    assert (f.peak_running, f.upscale_decided_s, f.scaled_up_s) == (2, 6.0, 50.0)
    assert (f.kill_detected_s, f.recovered_s) == (2.0, 50.0)
    assert f.failed_after_kill == 3 and f.failed_after_kill_by_type == {"APIError": 2, "InternalServerError (500)": 1}
    assert f.last_failure_after_kill_s == 4.0
    assert (f.in_flight_at_kill, f.in_flight_at_kill_failed, f.in_flight_at_kill_max_e2e_s) == (4, 2, 1.2)
    assert f.ok_during_recovery == 52  # ended after the kill, started before recovery: 79..130
    assert (f.failed_before_kill, f.failed_after_recovery) == (0, 0)
    assert f.scaled_down_s == 20.0  # a STOPPING replica takes no traffic: down to one at 170 s
    assert f.replica_changes[0] == (-10.0, {"RUNNING": 1})
    assert [t for t, _ in f.replica_changes] == [-10.0, 6.0, 50.0, 72.0, 120.0, 160.0, 180.0]


def test_findings_when_nothing_scaled():
    flat = [Sample(t=float(t), states={"RUNNING": 1}) for t in range(100)]
    f = findings(flat, [_request(10, 11, "RateLimitError (429)")], load_start=5, kill_at=None, load_stop=50)
    assert f.scaled_up_s is None and f.upscale_decided_s is None and f.recovered_s is None
    assert f.kill_detected_s is None and f.failed_before_kill == 1 and f.scaled_down_s == 0.0


def test_changes_keep_only_transitions():
    samples = [Sample(t=t, states=s) for t, s in ((0, {"RUNNING": 1}), (1, {"RUNNING": 1}), (2, {"RUNNING": 2}))]
    assert changes(samples, origin=1) == [(-1.0, {"RUNNING": 1}), (1.0, {"RUNNING": 2})]


def test_ray_start_commands_use_private_ports_and_temp_dir(tmp_path):
    head = ray_start_command(6400, 4, tmp_path)
    worker = ray_start_command(6400, 4, None)
    assert head[1:3] == ["start", "--head"] and "--temp-dir" in head and "--include-dashboard" in head
    assert worker[1:4] == ["start", "--address", "127.0.0.1:6400"] and "--temp-dir" not in worker
    for command in (head, worker):
        assert "--block" in command and command[command.index("--num-cpus") + 1] == "4"
        ports = [command[i + 1] for i, arg in enumerate(command) if arg.endswith("-port") and arg != "--port"]
        assert len(ports) == len(set(ports)) >= 6  # nothing on Ray's fixed defaults


def test_replica_titles():
    deployment = "LLMServer:tiny-chat"
    assert is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat"], deployment)
    assert is_replica_title(
        ["ray::ServeReplica:llm:LLMServer:tiny-chat.handle_request_with_rejection", "", "  "], deployment
    )
    assert is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat" + " " * 300], deployment)
    assert is_replica_title(
        ["ray::SERVE_REPLICA::llm#LLMServer:tiny-chat#w8kz8qmf:ServeReplica:llm:LLMServer:tiny-chat.__init__"],
        deployment,
    )
    assert not is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat-ngram"], deployment)
    assert not is_replica_title(["ray::ServeReplica:llm:OpenAiIngress"], deployment)
    assert not is_replica_title(["VLLM::EngineCore"], deployment) and not is_replica_title([], deployment)
