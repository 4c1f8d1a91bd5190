"""The gateway profile's pure part: py-spy's collapsed stacks broken down by concern and stage."""

from __future__ import annotations

from ops.benchmarks.profile_gateway import OUTSIDE, SYSCALLS, Frame, breakdown, parse_collapsed, parse_frame

ROOT = "_run_module_as_main (<frozen runpy>:198);Runner.run (asyncio/runners.py:118)"
TASK = (
    f"{ROOT};PublicApp.__call__ (serving/gateway/http/public_app.py:67)"
    ";AccessLogMiddleware.__call__ (serving/gateway/telemetry/access_log.py:143)"
    ";BodyDeadline.__call__ (serving/gateway/admission/body.py:176)"
    ";PublicApp._handle (serving/gateway/http/public_app.py:74)"
)
ADMIT = (
    f"{TASK};Gateway.handle (serving/gateway/pipeline/gateway.py:73)"
    ";Gateway._admit (serving/gateway/pipeline/gateway.py:93)"
    ";Admitter.admit (serving/gateway/admission/admitter.py:291)"
)
CHARGE = (
    f"{ADMIT};Admitter._admit_body (serving/gateway/admission/admitter.py:335)"
    ";Admitter._charge (serving/gateway/admission/admitter.py:399)"
    ";LimitCheck.run (serving/gateway/admission/limit_check.py:45)"
)
REDIS = "Redis.execute_command (redis/asyncio/client.py:979)"
READ = f"{ADMIT};Admitter._admit_body (serving/gateway/admission/admitter.py:335)"
SEND = (
    f"{TASK};UpstreamStream.__call__ (serving/gateway/upstream/proxy.py:183)"
    ";RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:522)"
)
# Six samples: two in Redis under the token charge (one through a contextlib helper), one in a
# write() syscall under uvicorn's send (py-spy --native), one in the garbage collector, one in our
# body reading, and one in a protocol callback outside the request's task.
PROFILE = f"""\
{CHARGE};{REDIS} 1
{CHARGE};_AsyncGeneratorContextManager.__aenter__ (contextlib.py:204);{REDIS} 1
{SEND};UVStream__try_write (loop.c:106818);write (libc.so.6) 1
{READ};Admitter._read (serving/gateway/admission/admitter.py:345);gc_collect_main (libpython3.11.so.1.0) 1
{READ};Admitter._read (serving/gateway/admission/admitter.py:347) 1
{ROOT};HttpToolsProtocol.data_received (uvicorn/protocols/http/httptools_impl.py:173) 1
"""


def test_parse_frame_reads_python_and_native_frames():
    assert parse_frame("Admitter._read (serving/gateway/admission/admitter.py:347)") == Frame(
        "Admitter._read", "serving/gateway/admission/admitter.py"
    )
    assert parse_frame("write (libc.so.6)") == Frame("write", "libc.so.6")
    assert parse_frame("0x7f20056b5c24") == Frame("0x7f20056b5c24", "")


def test_parse_collapsed_keeps_every_stack_root_first_with_its_count():
    stacks = parse_collapsed(PROFILE + "not a stack line\n")
    assert [s.samples for s in stacks] == [1] * 6
    assert stacks[0].frames[0].function == "_run_module_as_main"
    assert stacks[0].frames[-1] == Frame("Redis.execute_command", "redis/asyncio/client.py")


def test_breakdown_counts_each_sample_once_by_concern_and_inclusively_by_stage():
    result = breakdown(parse_collapsed(PROFILE))
    assert result.total == 6
    assert result.in_syscalls == 1
    # Self: the innermost known concern; contextlib counts for its caller, the GC for itself.
    assert dict((name, count) for name, count, _ in result.by_concern) == {
        "redis-py": 2,
        SYSCALLS: 1,
        "garbage collector": 1,
        "gateway/admission": 1,
        "uvicorn (server HTTP)": 1,
    }
    stages = {name.strip(): (count, not_in_syscalls) for name, count, not_in_syscalls in result.by_stage}
    assert stages["request task (PublicApp)"] == (5, 4)
    assert stages["admit"] == (4, 4)
    assert stages["limit: tokens (charge)"] == (2, 2)
    assert stages["read body"] == (2, 2)
    assert stages["response relay (meter, settle, send)"] == (1, 0)
    assert stages[OUTSIDE] == (1, 1)
    assert "limit: concurrency slot" not in stages  # the charge's limit call is not admit's own
    assert result.top_functions[0] == ("Redis.execute_command (redis/asyncio/client.py)", 2, 2)
