"""The request path without HTTP: `Gateway.handle` called with a bare ASGI scope, an admission
whose limiter ticket and queue slot count how often they are settled and released, and a proxy
stage that fails in each way it can. Whatever way the request ends, the ticket is settled once
and the model's slot released once; a streamed answer takes both over and settles them itself.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.gateway.admission.admitter import Admission, reservation_for
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.decision import LimitDecision
from serving.gateway.limits.ticket import Ticket, Who
from serving.gateway.metering.usage_meter import NOTHING_BILLED, Usage, UsageMeter
from serving.gateway.pipeline.gateway import Gateway
from serving.gateway.protocol import errors
from serving.gateway.queue.fair_queue import QueueTicket
from serving.gateway.upstream.proxy import UpstreamStream
from tests.support.gateway import gateway_settings

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
SETTINGS = gateway_settings("http://127.0.0.1:1", None)


class CountingBackend:
    """A limiter backend (serving.gateway.limits.ticket.LimiterBackend) that records each settlement."""

    shared = True

    def __init__(self) -> None:
        self.settled: list[tuple[Usage, bool]] = []

    async def admit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("admission happened before the pipeline's stages under test")

    async def settle(self, ticket: Ticket, billed: Usage, *, give_back_request: bool, along: Any = None) -> None:
        self.settled.append((billed, give_back_request))

    async def aclose(self) -> None:
        return None


class CountingQueue:
    """What a QueueTicket calls on its queue to release a slot, counted."""

    def __init__(self) -> None:
        self.releases = 0

    def _release_call(self, ticket: QueueTicket) -> object:
        return object()

    async def _finish_release(self, model: str, call: object) -> None:
        self.releases += 1


class FailingProxy:
    """The proxy stage: raises `error`, or answers `response`."""

    def __init__(self, error: BaseException | None = None, response: Response | None = None) -> None:
        self.error, self.response, self.calls = error, response, 0

    async def forward(self, *args: Any, **kwargs: Any) -> Response:
        self.calls += 1
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


class OneAdmission:
    """The admission stages, done: always the same admitted request."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def admit(self, request: Request) -> Admission:
        return self.admission


def admitted(backend: CountingBackend, queue: CountingQueue, *, allowed_models: list[str] | None = None) -> Admission:
    decision = LimitDecision(
        allowed=True,
        refused=None,
        limit_requests=10,
        remaining_requests=9,
        reset_requests_s=6,
        limit_tokens=1000,
        remaining_tokens=900,
        reset_tokens_s=6,
        retry_after_s=None,
    )
    who = Who(key_id="k", tenant="t", limits=KeyLimits(), tenant_defaults=TenantLimits())
    ticket = Ticket(who=who, decision=decision, reserved=100, backend=backend)
    slot = QueueTicket("tiny", "t", "standard", "slot-1", 0.0, False, queue, 0.0)  # type: ignore[arg-type]
    key = KeyRecord(key_id="k", tenant="t", name="n", created_at=datetime.now(UTC), allowed_models=allowed_models)
    reservation, _ = reservation_for(BODY, 100, CHAT, SETTINGS)
    return Admission(
        key=key,
        body=b"{}",
        model="tiny",
        ticket=ticket,
        headers={"x-ratelimit-limit-requests": "10"},
        meter=UsageMeter(stream=False, reservation=reservation),
        queue_ticket=slot,
    )


def request(path: str = CHAT, method: str = "POST") -> Request:
    return Request(
        {
            "type": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "scheme": "http",
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 5000),
        }
    )


def run(
    proxy: FailingProxy, *, path: str = CHAT, method: str = "POST", allowed_models: list[str] | None = None
) -> tuple[Response | BaseException, CountingBackend, CountingQueue]:
    backend, queue = CountingBackend(), CountingQueue()
    gateway = Gateway(
        SETTINGS,
        OneAdmission(admitted(backend, queue, allowed_models=allowed_models)),  # type: ignore[arg-type]
        proxy,
    )  # type: ignore[arg-type]

    async def go() -> Response | BaseException:
        try:
            return await gateway.handle(request(path, method))
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            return exc

    return asyncio.run(go()), backend, queue


@pytest.mark.parametrize(
    "error",
    [RuntimeError("proxy bug"), asyncio.CancelledError(), KeyboardInterrupt()],
    ids=["exception", "cancelled", "interrupt"],
)
def test_a_failing_proxy_stage_settles_the_ticket_and_releases_the_slot_once(error):
    outcome, backend, queue = run(FailingProxy(error=error))
    assert outcome is error
    assert backend.settled == [(NOTHING_BILLED, False)]  # once, nothing billed: nothing was generated
    assert queue.releases == 1


def test_an_upstream_error_is_billed_what_the_meter_says_once_and_answered_with_the_limit_headers():
    outcome, backend, queue = run(FailingProxy(response=errors.response_for(errors.upstream_failed())))
    assert isinstance(outcome, JSONResponse) and outcome.status_code == 502
    assert outcome.headers["x-ratelimit-limit-requests"] == "10"
    assert len(backend.settled) == 1 and queue.releases == 1
    assert backend.settled[0][0] == NOTHING_BILLED  # a refusal from the upstream generated nothing


def test_a_model_the_key_may_not_use_is_refused_before_the_proxy_and_settled_once():
    proxy = FailingProxy(response=Response(status_code=200))
    outcome, backend, queue = run(proxy, path="/v1/models/other", method="GET", allowed_models=["tiny"])
    assert isinstance(outcome, JSONResponse) and outcome.status_code == 404 and proxy.calls == 0
    assert backend.settled == [(NOTHING_BILLED, False)] and queue.releases == 1


def test_a_route_outside_the_allowlist_never_reaches_admission():
    outcome, backend, queue = run(FailingProxy(error=AssertionError("proxied")), path="/v1/../admin", method="GET")
    assert isinstance(outcome, JSONResponse) and outcome.status_code == 404
    assert backend.settled == [] and queue.releases == 0


class Connection:
    """The upstream connection as the proxy hands it to the request's exit stack."""

    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


class ConnectingProxy:
    """A proxy stage that got its upstream connection, then raises `error` or streams."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.connection = error, Connection()

    async def forward(self, *args: Any, held: Any = None, **kwargs: Any) -> Response:
        held.callback(self.connection.close)
        if self.error is not None:
            raise self.error
        upstream = type("Upstream", (), {"status": 200, "raw_headers": []})()
        return UpstreamStream(
            upstream,
            kwargs["meter"],
            kwargs["settle"],
            {},
            deadline=0.0,  # type: ignore[arg-type]
            metrics=None,
        )  # type: ignore[arg-type]


def test_a_failure_after_the_upstream_answered_closes_its_connection_and_settles_once():
    proxy = ConnectingProxy(error=RuntimeError("relay bug"))
    outcome, backend, queue = run(proxy)  # type: ignore[arg-type]
    assert isinstance(outcome, RuntimeError)
    assert proxy.connection.closes == 1
    assert backend.settled == [(NOTHING_BILLED, False)] and queue.releases == 1


def test_a_streamed_answer_takes_the_connection_and_the_settlement_over():
    proxy = ConnectingProxy()
    outcome, backend, queue = run(proxy)  # type: ignore[arg-type]
    assert isinstance(outcome, UpstreamStream)
    # Nothing closed or settled yet: the relay does both when it ends (tests/serving/gateway/upstream).
    assert proxy.connection.closes == 0 and backend.settled == [] and queue.releases == 0
