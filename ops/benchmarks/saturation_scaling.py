"""Scaling on saturation vs on ongoing requests, on `make dev`, with the same load in one run.

    python -m ops.benchmarks.saturation_scaling [--out build/bench/saturation_scaling.json] \
        [--stack tests/stacks/Pulumi.saturation.yaml] [--phase 180] [--steady 600]

1. Starts `make dev` (`python -m ops.devstack --ready-json`) on a stack with the same tiny model
   twice, identical but for `autoscaling.policy` (tests/stacks/Pulumi.saturation.yaml explains the
   shape): the gateway, its fair queue in a private Redis, Ray Serve, CPU vLLM.
2. Ongoing phase: a closed loop of `--concurrency` clients (official `openai` client, through the
   gateway) sends long prompts to the model on `ongoing` for `--phase` seconds. The replica takes
   2 at once; the gateway queues the rest, so Serve counts 2 ongoing against a target of 2.
3. Saturation phase: the same load on the model on `saturation`, until a second replica runs
   (`--scale-timeout`), then `--steady` seconds more: the steady phase.
4. Every second it samples each model's Serve deployment (replicas running, Serve's target); every
   request keeps its queue wait as the gateway reports it (`x-queue-wait-ms`: the time it waited
   for a slot in the fair queue). The findings (`saturation_findings`): replica changes and
   queue wait p50/p90 per phase; for saturation, p90 before the second replica ran and in the
   steady phase; flapping = any change of Serve's target or of the running replicas in the
   steady phase (after the scale-up settled).
Writes samples, requests and findings to the JSON file, then stops `make dev` (SIGTERM: it
stops Ray and every process it started). Evidence, not a test: minutes long, and its timings
depend on the machine's load (recorded at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from infra.render.serve_config import llm_deployment_name
from infra.spec.schema import ScalingPolicy
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.harness.processes import free_port, stop_tree
from ops.llmctl.bench.loadgen import make_prompt
from serving.gateway.admission.queue_wait import QUEUE_WAIT_HEADER

DEFAULT_STACK = "tests/stacks/Pulumi.saturation.yaml"
SETTLE_S = 10.0  # after a phase starts, or a replica joins: the queue drains to its new level


def say(message: str) -> None:
    print(f"[saturation-scaling] {message}", file=sys.stderr, flush=True)


# --- what is measured, and what it shows (pure) ---------------------------------------------


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the run's start
    running: int  # replicas RUNNING
    target: int | None  # Serve's target replica count


@dataclass(frozen=True)
class Request:
    start: float
    end: float
    queue_wait_s: float | None  # from the gateway's header; None when the request failed
    error: str | None = None


class Waits(BaseModel):
    requests: int
    errors: int
    p50_s: float | None
    p90_s: float | None


class PhaseFindings(BaseModel):
    replicas_max: int
    changes: int  # changes of (running, target) over the phase
    waits: Waits


class SaturationFindings(BaseModel):
    ongoing: PhaseFindings
    saturation: PhaseFindings
    scale_up_decided_s: float | None  # Serve's target above 1, after the saturation phase started
    second_replica_running_s: float | None
    before_scale_up: Waits  # saturation phase, requests started before the second replica ran
    steady: PhaseFindings | None  # from SETTLE_S after the second replica ran to the end of the load
    p90_fell: bool | None  # steady p90 under the p90 before the scale-up
    flapping: bool | None  # any change in the steady phase


def waits(requests: Sequence[Request], start: float, end: float) -> Waits:
    """Queue waits of the requests that started in [start, end)."""
    chosen = [r for r in requests if start <= r.start < end]
    ok = [r.queue_wait_s for r in chosen if r.error is None and r.queue_wait_s is not None]
    p50, p90 = (float(np.percentile(ok, q)) for q in (50, 90)) if ok else (None, None)
    return Waits(requests=len(chosen), errors=sum(r.error is not None for r in chosen), p50_s=p50, p90_s=p90)


def changes(samples: Sequence[Sample]) -> int:
    return sum((a.running, a.target) != (b.running, b.target) for a, b in zip(samples, samples[1:]))


def phase(
    samples: Sequence[Sample], requests: Sequence[Request], start: float, end: float, settle_s: float = SETTLE_S
) -> PhaseFindings:
    """Replicas over [start, end); queue waits of the requests started from `settle_s` in."""
    inside = [s for s in samples if start <= s.t < end]
    return PhaseFindings(
        replicas_max=max((s.running for s in inside), default=0),
        changes=changes(inside),
        waits=waits(requests, start + settle_s, end),
    )


def saturation_findings(
    ongoing: tuple[Sequence[Sample], Sequence[Request], float, float],
    saturation: tuple[Sequence[Sample], Sequence[Request], float, float],
) -> SaturationFindings:
    """Each phase: its model's samples and requests, and when its load started and stopped."""
    samples, requests, start, end = saturation
    decided = next((s.t for s in samples if s.t >= start and (s.target or 0) > 1), None)
    running = next((s.t for s in samples if s.t >= start and s.running > 1), None)
    # The steady phase: from SETTLE_S after the second replica ran to the end of the load. Any
    # change of Serve's target or of the running replicas in it is flapping.
    steady = phase(samples, requests, running + SETTLE_S, end, settle_s=0) if running is not None else None
    before = waits(requests, start + SETTLE_S, running if running is not None else end)
    fell = None
    if steady is not None and steady.waits.p90_s is not None and before.p90_s is not None:
        fell = steady.waits.p90_s < before.p90_s
    return SaturationFindings(
        ongoing=phase(*ongoing),
        saturation=phase(samples, requests, start, end),
        scale_up_decided_s=None if decided is None else round(decided - start, 1),
        second_replica_running_s=None if running is None else round(running - start, 1),
        before_scale_up=before,
        steady=steady,
        p90_fell=fell,
        flapping=None if steady is None else steady.changes > 0,
    )


# --- the run (I/O) --------------------------------------------------------------------------


class DevStack:
    """`python -m ops.devstack --ready-json` in its own session, stopped by SIGTERM to its id."""

    def __init__(self, stack: str, log: Path) -> None:
        self.log = log.open("w")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.devstack", "--stack", stack, "--ready-json", "--port", str(free_port())],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in self.process.stdout:
            if line.startswith("{") and '"ready"' in line:
                return json.loads(line)
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"make dev did not get ready (exit {self.process.poll()}); see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                stop_tree(self.process, 10)
        self.log.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def deployments(stack: str) -> dict[ScalingPolicy, tuple[str, str]]:
    """policy -> (served model name, Serve deployment name), one model per policy."""
    spec = load_stack(stack)
    found = {m.autoscaling.policy: (m.model_name, llm_deployment_name(m)) for m in spec.models}
    assert set(found) == set(ScalingPolicy), f"{stack}: one model per policy, got {sorted(found)}"
    return found


def replica_sample(details: dict[str, Any], deployment: str, t: float) -> Sample:
    for application in details.get("applications", {}).values():
        found = (application.get("deployments") or {}).get(deployment)
        if found is not None:
            replicas = found.get("replicas") or []
            target = found.get("target_num_replicas")
            return Sample(
                t, sum(r.get("state") == "RUNNING" for r in replicas), None if target is None else int(target)
            )
    return Sample(t, 0, None)


class Load(threading.Thread):
    """`concurrency` clients, each sending the next request when its last one ends."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        concurrency: int,
        prompt_words: int,
        output: int,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(daemon=True)
        self.base_url, self.api_key, self.model = base_url, api_key, model
        self.concurrency, self.prompt_words, self.output, self.clock = concurrency, prompt_words, output, clock
        self.stop, self.requests = threading.Event(), list[Request]()

    def run(self) -> None:
        asyncio.run(self._clients())

    async def _clients(self) -> None:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=600)
        rng = np.random.default_rng(0)

        async def one() -> None:
            while not self.stop.is_set():
                # Fresh words each time: a repeated prompt would come from vLLM's prefix cache.
                prompt = make_prompt(rng, self.prompt_words)
                start = self.clock()
                try:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=self.model,
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=self.output,
                        extra_body={"ignore_eos": True},
                    )
                    raw.parse()
                    waited = raw.headers.get(QUEUE_WAIT_HEADER)
                    wait_s = float(waited) / 1000 if waited is not None else None
                    self.requests.append(Request(start, self.clock(), wait_s))
                except Exception as exc:  # noqa: BLE001  # a failed request is a finding, not the end of the run
                    self.requests.append(Request(start, self.clock(), None, type(exc).__name__))
                    await asyncio.sleep(1)

        await asyncio.gather(*(one() for _ in range(self.concurrency)))
        await client.close()


def run(args: argparse.Namespace, work: Path, record: dict[str, Any]) -> None:
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0  # noqa: E731
    models = deployments(args.stack)
    record.update(stack=args.stack, loadavg_at_start=os.getloadavg(), models={p.value: m for p, m in models.items()})
    dev = DevStack(args.stack, work / "devstack.log")
    samples: dict[ScalingPolicy, list[Sample]] = {p: [] for p in models}
    sampling = threading.Event()
    try:
        ready = dev.wait_ready(args.start_timeout)
        record["ready_s"] = round(clock(), 1)
        say(f"make dev ready in {record['ready_s']} s: {ready['base_url']}")
        from ops.devstack import serve as local_serve
        from ops.devstack.lock import find_running_dev

        running_dev = find_running_dev()
        assert running_dev is not None and running_dev.ray_address, "make dev recorded no Ray address"
        local_serve.connect(running_dev.ray_address, running_dev.ray_auth_mode)
        # Joining Ray as a driver replaced our SIGINT handler with one that swallowed Ctrl-C in a
        # run (make dev then lost its GCS under us, and Ray's core ended this process before the
        # record was written): Ctrl-C and SIGTERM stop the run, and make dev, here.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)

        def sample_every_second() -> None:
            while not sampling.is_set():
                try:
                    details = local_serve.details()
                except Exception as exc:  # noqa: BLE001  # one missed sample; the next may answer
                    say(f"sample missed: {type(exc).__name__}")
                else:
                    for policy, (_, deployment) in models.items():
                        samples[policy].append(replica_sample(details, deployment, clock()))
                sampling.wait(1.0)

        threading.Thread(target=sample_every_second, daemon=True).start()
        phases: dict[ScalingPolicy, tuple[float, float, list[Request]]] = {}
        for policy in (ScalingPolicy.ONGOING, ScalingPolicy.SATURATION):
            model = models[policy][0]
            load = Load(
                ready["base_url"],
                ready["api_key"],
                model,
                args.concurrency,
                args.prompt_words,
                args.output_tokens,
                clock,
            )
            start = clock()
            load.start()
            say(
                f"{policy.value}: {args.concurrency} clients, {args.prompt_words}-word prompts, "
                f"{args.output_tokens} tokens out, to {model}"
            )
            if policy is ScalingPolicy.ONGOING:
                time.sleep(args.phase)
            else:
                deadline = time.monotonic() + args.scale_timeout
                while not any(s.t >= start and s.running > 1 for s in samples[policy]) and time.monotonic() < deadline:
                    time.sleep(1)
                up = next((s.t for s in samples[policy] if s.t >= start and s.running > 1), None)
                say(
                    f"saturation: second replica running {up - start:.0f} s after load"
                    if up
                    else "saturation: no second replica"
                )
                time.sleep(args.steady + SETTLE_S if up else 0)
            load.stop.set()
            end = clock()
            load.join(timeout=600)
            phases[policy] = (start, end, list(load.requests))
            say(f"{policy.value}: {len(load.requests)} requests in {end - start:.0f} s")
            record["requests"] = {p.value: [asdict(r) for r in phases[p][2]] for p in phases}
            record["phases_s"] = {p.value: [round(phases[p][0], 1), round(phases[p][1], 1)] for p in phases}
        sampling.set()
        findings = saturation_findings(
            *(
                (samples[p], phases[p][2], phases[p][0], phases[p][1])
                for p in (ScalingPolicy.ONGOING, ScalingPolicy.SATURATION)
            )
        )
        record["findings"] = findings.model_dump()
    finally:
        sampling.set()
        record["samples"] = {p.value: [asdict(s) for s in samples[p]] for p in samples}
        record["loadavg_at_end"] = os.getloadavg()
        import ray

        if ray.is_initialized():
            ray.shutdown()
        say("stopping make dev ...")
        dev.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.benchmarks.saturation_scaling", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--stack", default=DEFAULT_STACK, help="one model on each policy, otherwise the same")
    parser.add_argument("--out", type=Path, default=Path("build/bench/saturation_scaling.json"))
    parser.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop (default 4)")
    parser.add_argument("--prompt-words", type=int, default=1200, help="words per prompt (default 1200)")
    parser.add_argument("--output-tokens", type=int, default=16, help="max_tokens, generated in full (default 16)")
    parser.add_argument("--phase", type=float, default=180, help="seconds of load on the ongoing model")
    parser.add_argument("--steady", type=float, default=600, help="seconds of load after the scale-up settled")
    parser.add_argument("--scale-timeout", type=float, default=600, help="longest wait for the second replica")
    parser.add_argument("--start-timeout", type=float, default=900, help="longest wait for make dev")
    args = parser.parse_args(argv)
    import tempfile

    record: dict[str, Any] = {
        "command": "python -m ops.benchmarks.saturation_scaling " + " ".join(argv or sys.argv[1:])
    }
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="llmsat-") as folder:
            try:
                run(args, Path(folder), record)
            finally:
                log = Path(folder) / "devstack.log"
                record["devstack_log_tail"] = log.read_text().splitlines()[-40:] if log.is_file() else []
    except (RuntimeError, TimeoutError, KeyboardInterrupt, AssertionError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        say(f"error: {record['error']}")
    finally:
        record["wall_time_s"] = round(time.monotonic() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
    if "findings" not in record:
        return 1
    f = SaturationFindings.model_validate(record["findings"])
    say(
        f"ongoing: max {f.ongoing.replicas_max} replica(s), queue wait p90 {f.ongoing.waits.p90_s}; saturation: "
        f"decided {f.scale_up_decided_s} s, running {f.second_replica_running_s} s, p90 {f.before_scale_up.p90_s} -> "
        f"{f.steady.waits.p90_s if f.steady else None} s (fell: {f.p90_fell}), "
        f"steady changes {f.steady.changes if f.steady else None} (flapping: {f.flapping}); "
        f"written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
