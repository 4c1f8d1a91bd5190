"""Where the gateway's CPU goes per non-streamed request, saturated: a py-spy profile of the
setup `ops.benchmarks.gateway` measures (redis-server, the stub upstream, `python -m
serving.gateway`, wrk with 100 connections sending non-streamed chat completions back to back),
broken down by concern.

    python -m ops.benchmarks.profile_gateway [--duration 15] [--rate 250] [--native] [--raw /tmp/prof.txt]

wrk runs for `--duration` plus a few seconds each side, py-spy records the gateway for
`--duration` in the middle (`py-spy record --format raw`: one collapsed stack per line, root
first, and its sample count; idle samples left out, so the samples are the process's busy time,
or its time waiting for a core on a loaded machine). Three views of the same samples:

- by concern, self: each sample counted once, for the innermost frame that belongs to a known
  concern (our gateway's packages, uvicorn, starlette, redis-py, aiohttp, ...). Small standard
  library helpers (contextlib, functools, typing, ...) count for their caller: an `async with`
  of ours is ours. A sample whose leaf is the event loop's own code is the event loop's.
- by stage, inclusive: the share of samples with a stage's function on the stack (the pipeline's
  stages, serving.gateway.pipeline.gateway and serving.gateway.admission.admitter), and the
  share outside the request's task (the server's and the clients' protocol callbacks).
- the leaf functions with the most samples.

py-spy needs ptrace rights over the gateway (root, or CAP_SYS_PTRACE). Shares matter, not
absolute times: on a loaded machine the samples include time spent waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ops.benchmarks.gateway import CONNECTIONS, parse_wrk, wrk_script
from ops.devstack.local_redis import start_redis
from ops.harness.processes import terminate
from ops.harness.stub_gateway import GENEROUS, running_gateway, running_stub
from serving.gateway.auth.keys import create_key_sync

ROOT = "_run_module_as_main"  # the outermost frame of `python -m serving.gateway`
SLOT = "    limit: concurrency slot"
SYSCALLS = "syscalls (write, read, getpid, ...)"
WARM_UP_S = 3  # wrk runs this long before py-spy starts, and as long again after it stops


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # as py-spy names it: a path, a shared library, or "" (a native frame without one)


@dataclass(frozen=True)
class Stack:
    frames: tuple[Frame, ...]  # root first
    samples: int


_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def parse_frame(text: str) -> Frame:
    """`function (file:line)` as py-spy writes a frame; a native frame may have no file."""
    match = _FRAME.match(text.strip())
    if match is None:
        return Frame(text.strip(), "")
    return Frame(match["function"], match["file"])


def parse_collapsed(text: str) -> list[Stack]:
    """py-spy's raw format (Brendan Gregg's collapsed stacks): `frame;frame;... count` per line."""
    stacks = []
    for line in text.splitlines():
        frames, _, count = line.rstrip().rpartition(" ")
        if frames and count.isdigit():
            stacks.append(Stack(tuple(parse_frame(f) for f in frames.split(";")), int(count)))
    return stacks


# Standard library modules whose frames count for their caller (helpers, not a concern of their own).
_TRANSPARENT = frozenset(
    {"contextlib", "functools", "typing", "abc", "enum", "dataclasses", "copy", "weakref", "_weakrefset"}
    | {"collections", "types", "re", "operator", "warnings", "runpy"}
)
# A frame's top-level module (py-spy names files relative to sys.path) -> its concern.
_LIBRARIES = {
    "uvicorn": "uvicorn (server HTTP)",
    "httptools": "httptools (HTTP parser)",
    "starlette": "starlette",
    "redis": "redis-py",
    "hiredis": "redis-py",
    "aiohttp": "aiohttp (upstream client)",
    "aiohttp_retry": "aiohttp (upstream client)",
    "yarl": "yarl/multidict",
    "multidict": "yarl/multidict",
    "propcache": "yarl/multidict",
    "orjson": "orjson",
    "json": "json (stdlib)",
    "logging": "logging",
    "pythonjsonlogger": "logging",
    "prometheus_client": "prometheus_client",
    "opentelemetry": "opentelemetry",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "anyio": "anyio/sniffio",
    "sniffio": "anyio/sniffio",
    "asyncio": "event loop (uvloop/asyncio)",
    "uvloop": "event loop (uvloop/asyncio)",
    "selectors": "event loop (uvloop/asyncio)",
}
# Native frames (py-spy --native, named by their C source or library): the ones named here have a
# concern of their own; CPython's own C and the rest count for the Python frame that runs them.
_NATIVE = (
    ("garbage collector", re.compile(r"^gc_|\(gcmodule\.c")),
    (
        SYSCALLS,
        re.compile(r"^_*(write|writev|read|readv|send\w*|recv\w*|epoll_\w+|getpid|close|accept4?|futex) \(libc"),
    ),
    ("libc (malloc, memcpy, ...)", re.compile(r"\((libc\.so|libc-|libpthread|\[vdso\]|\[kernel)")),
    (
        "event loop (uvloop/asyncio)",
        re.compile(
            r"\((loop|core|loop-watcher|stream|linux|timer|tcp|uv-common|_asynciomodule)\.c|\((queue|heap-inl)\.h"
        ),
    ),
    ("aiohttp (upstream client)", re.compile(r"\(_http_(parser|writer)\.c")),
    ("yarl/multidict", re.compile(r"\((_multidict|_quoting_c|_helpers_c)\.c|\((yarl|multidict|propcache)/")),
    ("redis-py", re.compile(r"\((pack|reader|read|hiredis|sds)\.c")),
    ("pydantic", re.compile(r"pydantic_core")),
    ("json (stdlib)", re.compile(r"\(_json\.c")),
    ("orjson", re.compile(r"orjson")),
)
_GATEWAY = re.compile(r"(^|/)serving/gateway/(?P<package>\w+)/(?P<module>\w+)\.py$")
_SPLIT_MODULES = {"telemetry"}  # packages reported per module: access log, metrics, tracing apart


def concern_of(frame: Frame) -> str | None:
    """The concern a frame belongs to; None for a helper that counts for its caller."""
    if not frame.file.endswith(".py"):
        named = f"{frame.function} ({frame.file})"
        return next((concern for concern, pattern in _NATIVE if pattern.search(named)), None)
    gateway = _GATEWAY.search(frame.file)
    if gateway is not None:
        package = gateway["package"]
        return f"gateway/{package}/{gateway['module']}" if package in _SPLIT_MODULES else f"gateway/{package}"
    if "serving/gateway/" in frame.file:
        return "gateway (other)"
    top = re.split(r"[/.]", frame.file, maxsplit=1)[0]
    if top in _TRANSPARENT:
        return None
    if top in _LIBRARIES:
        return _LIBRARIES[top]
    return "stdlib (other)" if top in sys.stdlib_module_names else "other"


def self_concern(stack: Stack) -> str:
    """The innermost frame's concern, skipping helpers that count for their caller."""
    for frame in reversed(stack.frames):
        concern = concern_of(frame)
        if concern is not None:
            return concern
    return "other"


# The pipeline's stages, as the functions that run them (file suffix, qualified name), outermost first.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("request task (PublicApp)", "http/public_app.py", "PublicApp.__call__"),
    ("access log middleware", "telemetry/access_log.py", "AccessLogMiddleware.__call__"),
    ("body deadline middleware", "admission/body.py", "BodyDeadline.__call__"),
    ("Gateway.handle", "pipeline/gateway.py", "Gateway.handle"),
    ("  route", "protocol/routes.py", "resolve"),
    ("  admit", "admission/admitter.py", "Admitter.admit"),
    ("    authenticate", "admission/authenticate.py", "Authenticator.authenticate"),
    (SLOT, "admission/admitter.py", "Admitter.admit"),  # its own limit call only: stages_of
    ("    read body", "admission/admitter.py", "Admitter._read"),
    ("    validate", "admission/admitter.py", "Admitter._validate"),
    ("    reserve", "admission/admitter.py", "reservation_for"),
    ("    limit: tokens (charge)", "admission/admitter.py", "Admitter._charge"),
    ("    queue (place)", "admission/admitter.py", "Admitter._place"),
    ("  serve", "pipeline/gateway.py", "Gateway._serve"),
    ("    proxy: upstream request", "upstream/proxy.py", "UpstreamProxy.forward"),
    ("  response relay (meter, settle, send)", "upstream/proxy.py", "UpstreamStream.__call__"),
    ("  Admission.settle (anywhere)", "admission/admitter.py", "Admission.settle"),
    ("access log end (_ended)", "telemetry/access_log.py", "AccessLogMiddleware._ended"),
    ("  metrics (_observe)", "telemetry/access_log.py", "AccessLogMiddleware._observe"),
    ("  access line (json)", "telemetry/access_log.py", "access_line"),
    ("  logging (log.info, anywhere)", "logging/__init__.py", "Logger.info"),
)
OUTSIDE = "outside the request task (protocol callbacks)"
PARTIAL = "partial stack (py-spy read no root)"


def _has(stack: Stack, file_suffix: str, function: str) -> int:
    """Index of the outermost frame running `function` of a file ending in `file_suffix`, or -1."""
    for index, frame in enumerate(stack.frames):
        if frame.function == function and frame.file.endswith(file_suffix):
            return index
    return -1


def stages_of(stack: Stack) -> set[str]:
    """The stages a sample is in (inclusive: a stage contains the stages it calls)."""
    found = set()
    for label, suffix, function in STAGES:
        index = _has(stack, suffix, function)
        if index < 0:
            continue
        below = stack.frames[index + 1 :]
        # The slot stage is admit's own limit call, not the ones of the body stages under it.
        if label == SLOT and (
            not any(f.file.endswith("admission/limit_check.py") for f in below)
            or any(f.function == "Admitter._admit_body" for f in below)
        ):
            continue
        found.add(label)
    if not found:
        rooted = any(frame.function == ROOT for frame in stack.frames[:2])  # --native: libc's entry first
        found.add(OUTSIDE if rooted else PARTIAL)
    return found


Row = tuple[str, int, int]  # name, samples, samples not in a syscall


@dataclass(frozen=True)
class Breakdown:
    """The samples' three views. Each row also counts its samples outside syscalls: on a loaded
    machine a thread preempted as its write() wakes the reader is runnable, and py-spy counts
    it busy, so syscalls' share of samples can be far above their share of CPU (compare with the
    system CPU share); without them, the rest is in proportion to user CPU."""

    total: int
    in_syscalls: int
    by_concern: list[Row]
    by_stage: list[Row]  # in STAGES order, then the share outside the request task
    top_functions: list[Row]


def breakdown(stacks: Iterable[Stack], top: int = 10) -> Breakdown:
    """The three views of the samples (see the module's docstring)."""
    concerns: Counter[tuple[str, bool]] = Counter()
    stages: Counter[tuple[str, bool]] = Counter()
    leaves: Counter[tuple[str, bool]] = Counter()
    for stack in stacks:
        concern = self_concern(stack)
        syscall = concern == SYSCALLS
        concerns[concern, syscall] += stack.samples
        for stage in stages_of(stack):
            stages[stage, syscall] += stack.samples
        if stack.frames:
            leaf = stack.frames[-1]
            leaves[f"{leaf.function} ({_short(leaf.file)})", syscall] += stack.samples
    total = sum(concerns.values())
    order = [label for label, _, _ in STAGES] + [OUTSIDE, PARTIAL]
    return Breakdown(
        total=total,
        in_syscalls=concerns[SYSCALLS, True],
        by_concern=_rows(concerns),
        by_stage=[row for row in _rows(stages, order) if row[1]],
        top_functions=_rows(leaves)[:top],
    )


def _rows(counts: Counter[tuple[str, bool]], order: Sequence[str] | None = None) -> list[Row]:
    """(name, all samples, samples outside syscalls), most samples first unless `order` is given."""
    names = (
        order
        if order is not None
        else sorted({n for n, _ in counts}, key=lambda n: -counts[n, False] - counts[n, True])
    )
    return [(name, counts[name, False] + counts[name, True], counts[name, False]) for name in names]


def _short(file: str) -> str:
    """A path from its package on, as py-spy names it (relative to sys.path) or a native file."""
    match = re.search(r"serving/.*$", file)
    return match.group(0) if match else file


def table(title: str, rows: Sequence[Row], total: int, in_syscalls: int) -> str:
    width = max([len(title), *(len(name) for name, _, _ in rows)])
    outside = max(total - in_syscalls, 1)
    lines = [f"{title:<{width}}  {'%':>6}  {'% w/o syscalls':>14}  {'samples':>8}"]
    for name, count, not_in_syscalls in rows:
        share = "-" if name == SYSCALLS else f"{100 * not_in_syscalls / outside:.1f}"
        lines.append(f"{name:<{width}}  {100 * count / max(total, 1):6.1f}  {share:>14}  {count:8d}")
    return "\n".join(lines)


def report(result: Breakdown) -> str:
    views = (
        ("by concern (self)", result.by_concern),
        ("by stage (inclusive)", result.by_stage),
        ("top functions (self)", result.top_functions),
    )
    return "\n\n".join(
        [f"{result.total} samples, {result.in_syscalls} of them in syscalls (leaf in libc: py-spy --native)"]
        + [table(title, rows, result.total, result.in_syscalls) for title, rows in views]
    )


def record(duration_s: int, rate: int, native: bool, raw: Path, folder: Path) -> str:
    """Start the setup, saturate the gateway with wrk, record it with py-spy; wrk's summary."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    with ExitStack() as stack:
        own_redis = start_redis()
        stack.callback(own_redis.stop)
        stub = stack.enter_context(running_stub(folder / "stub.log")).url
        gateway = stack.enter_context(
            running_gateway(
                folder / "gateway.log", upstream=stub, redis_url=own_redis.url, settings={"models": ["tiny"]}
            )
        )
        key = create_key_sync(own_redis.url, "bench", "bench", limits=GENEROUS)
        script = folder / "wrk.lua"
        script.write_text(wrk_script(key, 0))
        wrk_s = duration_s + 2 * WARM_UP_S
        wrk = subprocess.Popen(
            ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{wrk_s}s", "--timeout", "30s", "-s", str(script)]
            + [f"{gateway.url}/v1/chat/completions"],
            stdout=subprocess.PIPE,
            text=True,
        )
        stack.callback(terminate, wrk, 5)
        time.sleep(WARM_UP_S)
        command = [py_spy, "record", "--pid", str(gateway.process.pid), "--rate", str(rate)]
        command += ["--duration", str(duration_s), "--format", "raw", "--output", str(raw)]
        if native:
            command.append("--native")
        print("==>", " ".join(command), flush=True)
        before = ProcessCpu.of(gateway.process.pid)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(ProcessCpu.of(gateway.process.pid).since(before), flush=True)
        output, _ = wrk.communicate(timeout=wrk_s + 30)
        return output


@dataclass(frozen=True)
class ProcessCpu:
    """A process's CPU seconds (user, system) and involuntary context switches, at `at`: on a
    loaded machine a sample in a syscall may be the wait for a core after it (py-spy counts a
    runnable thread as busy), which the system share and the preemptions put in proportion."""

    at: float
    user_s: float
    system_s: float
    preempted: int

    @classmethod
    def of(cls, pid: int) -> ProcessCpu:
        import psutil

        process = psutil.Process(pid)
        times = process.cpu_times()
        return cls(time.monotonic(), times.user, times.system, process.num_ctx_switches().involuntary)

    def since(self, before: ProcessCpu) -> str:
        wall = self.at - before.at
        user, system = self.user_s - before.user_s, self.system_s - before.system_s
        return (
            f"gateway while recorded: {wall:.1f} s wall, CPU {user:.1f} s user + {system:.1f} s system "
            f"({100 * (user + system) / wall:.0f}% of a core, system {100 * system / max(user + system, 1e-9):.0f}% "
            f"of it), {(self.preempted - before.preempted) / wall:.0f} involuntary switches/s; "
            f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Profile the saturated gateway with py-spy, broken down by concern.")
    parser.add_argument("--duration", type=int, default=15, help="seconds py-spy records (wrk runs 6 s longer)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="also sample C frames (py-spy --native)")
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    parser.add_argument("--from-raw", type=Path, help="only break down a recorded profile (no run)")
    parser.add_argument("--top", type=int, default=10, help="how many leaf functions to list")
    args = parser.parse_args()
    if args.from_raw is None:
        folder = Path(tempfile.mkdtemp(prefix="llmstack-profile-gateway-"))
        raw = args.raw or folder / "profile.txt"
        wrk_output = record(args.duration, args.rate, args.native, raw, folder)
        print(f"wrk: {parse_wrk(wrk_output)['requests_per_s']:.0f} requests/s over the whole run", flush=True)
    else:
        raw = args.from_raw
    print(report(breakdown(parse_collapsed(raw.read_text()), top=args.top)))


if __name__ == "__main__":
    main()
