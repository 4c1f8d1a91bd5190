"""The autoscaling demo's findings, on a hand-made timeline: load starts at 10 s, a second
replica is made at 16 s and runs at 60 s, one is killed at 80 s, Serve notices at 82 s and
runs two again at 130 s; load stops at 150 s, one replica stops at 170 s and is gone at 190 s."""

from __future__ import annotations

from infra.spec.stack_file import load_stack
from ops.benchmarks.autoscale_demo import (
    demo_gateway_settings,
    pick_victim,
    ray_start_command,
    streams_in_flight,
)
from ops.benchmarks.autoscale_timeline import Sample, changes, findings, gaps_at
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


def test_the_gap_is_measured_on_the_streams_in_flight_at_the_kill():
    # kill at 80: a stream reading every 0.1 s pauses from 79.9 to 81.4; one still in prefill
    # gets its first chunk 2 s after the kill; one that ended before, or got nothing after, has no gap.
    streaming = RequestResult(start=79, end=83, chunk_times=[79.8, 79.9, 81.4, 81.5])
    prefill = RequestResult(start=79.9, end=84, chunk_times=[82.0, 82.1])
    cut = RequestResult(start=79, end=80.5, chunk_times=[79.5], error="IncompleteStream")
    done = RequestResult(start=70, end=75, chunk_times=[71, 74])
    gaps = gaps_at([streaming, prefill, cut, done], kill_at=80)
    assert [round(g, 3) for g in gaps] == [1.5, 2.0]
    f = findings(SAMPLES, [streaming, prefill, cut, done], load_start=10, kill_at=80, load_stop=150)
    assert f.in_flight_at_kill == 3 and f.in_flight_at_kill_failed == 1
    assert f.in_flight_gap_s == {"p50": 1.5, "p99": 2.0, "max": 2.0}


def test_no_kill_no_gap():
    f = findings(SAMPLES, [_request(10, 11)], load_start=5, kill_at=None, load_stop=50)
    assert f.in_flight_gap_s == {"p50": None, "p99": None, "max": None}


def test_the_victim_is_the_busiest_replica_or_the_worker_node_hosting_one():
    # (node index, CPU seconds just used, pid); node 0 is the head (GCS, Serve's controller, HAProxy)
    replicas = [(1, 0.02, 22), (0, 0.4, 11)]
    assert pick_victim(replicas, "replica") == (0, 11)
    assert pick_victim(replicas, "node") == (1, 22)
    assert pick_victim([(1, 0.4, 22), (0, 0.02, 11)], "replica") == (1, 22)
    assert pick_victim([(0, 0.1, 11), (0, 0.2, 12)], "node") is None  # no worker node hosts one
    assert pick_victim([], "replica") is None


def test_the_gateway_in_front_of_the_demo_resumes_streams_and_takes_the_loadgens_body():
    settings = demo_gateway_settings(load_stack("tests/stacks/Pulumi.autoscale.yaml"))
    assert settings["stream_resume"]["enabled"] is True
    assert "ignore_eos" in settings["allowed_body_extensions"]  # the bench library asks for exact lengths
    assert settings["models"] == ["tiny-chat"] and settings["metrics_host"] == "127.0.0.1"
    # a fixed capacity: the gateway's queue would otherwise keep the load from the replicas
    assert settings["model_capacities"]["tiny-chat"]["adaptive"] is False


def test_streams_in_flight_are_the_arrivals_due_less_those_ended():
    due = [0.0, 0.4, 0.9, 1.5, 3.0]
    assert streams_in_flight(due, elapsed_s=1.0, ended=1) == 2  # 3 sent by 1.0 s, 1 ended
    assert streams_in_flight(due, elapsed_s=0.0, ended=0) == 1  # the first is sent at once
    assert streams_in_flight(due, elapsed_s=10.0, ended=5) == 0
