"""The gateway benchmark's pure parts: reading wrk's report and writing its Lua script."""

from __future__ import annotations

from ops.benchmarks.gateway import parse_wrk, summary, wrk_script

WRK_REPORT = """Running 15s test @ http://127.0.0.1:40001/v1/chat/completions
  2 threads and 100 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20ms    2.31ms  48.20ms   95.12%
    Req/Sec   250.13     40.22   350.00     70.00%
  Latency Distribution
     50%  850.00us
     75%    1.10ms
     90%    1.90ms
     99%    1.05s
  7503 requests in 15.01s, 5.20MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 4
Requests/sec:    499.87
Transfer/sec:    354.60KB
"""


def test_parse_wrk_reads_percentiles_in_every_unit_and_the_errors():
    result = parse_wrk(WRK_REPORT)
    assert result == {
        "p50_ms": 0.85,
        "p75_ms": 1.1,
        "p90_ms": 1.9,
        "p99_ms": 1050.0,
        "requests_per_s": 499.87,
        "requests": 7503.0,
        "non_2xx": 4.0,
        "socket_errors": 5.0,
    }


def test_wrk_script_paces_only_when_asked_and_quotes_the_body_for_lua():
    assert "function delay() return math.floor(-math.log(1 - math.random()) * 200) end" in wrk_script("x", 200)
    assert "delay" not in wrk_script("sk-llm-x", 0)
    assert 'wrk.body = "{\\"model\\": \\"tiny\\"' in wrk_script("sk-llm-x", 0)


def test_summary_is_gateway_minus_direct_per_pace():
    direct = {"paced": {"1000": {"p50_ms": 1.0, "p99_ms": 4.0}}, "saturated": {"requests_per_s": 1000.0}}
    gateway = {
        "paced": {"1000": {"p50_ms": 1.5, "p99_ms": 6.0}},
        "saturated": {"requests_per_s": 400.0},
        "redis_commands_per_request": 3.0,
    }
    litellm = {"paced": {"1000": {"p50_ms": 30.0, "p99_ms": 90.0}}, "saturated": {"requests_per_s": 100.0}}
    assert summary({"direct": direct, "gateway": gateway, "litellm": litellm}) == {
        "gateway_added_ms_by_pace": {"1000": {"p50": 0.5, "p99": 2.0}},
        "gateway_saturated_over_direct": 0.4,
        "redis_commands_per_request": 3.0,
        "gateway_over_litellm_saturated": 4.0,
        "litellm_added_ms_by_pace": {"1000": {"p50": 29.0, "p99": 86.0}},
    }


def test_summary_reports_the_edge_hop_against_the_gateway_alone():
    def target(p50: float, p99: float, rps: float) -> dict:
        return {
            "paced": {"200": {"p50_ms": p50, "p99_ms": p99}},
            "saturated": {"requests_per_s": rps},
            "redis_commands_per_request": 3.0,
        }

    result = summary(
        {"direct": target(0.3, 0.8, 10_000), "gateway": target(2.3, 6.5, 800), "gateway_edge": target(2.6, 7.0, 760)}
    )
    assert result["edge_saturated_over_gateway"] == 0.95
    assert result["edge_added_ms_by_pace"] == {"200": {"p50": 0.3, "p99": 0.5}}
