"""A batch's input file, checked up front, line by line, with the checks admission applies.

Each line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
Two kinds of problems, as OpenAI reports them:

- the file as a whole cannot be a batch (not UTF-8 JSONL, a line that is not a JSON object or has no
  usable `custom_id`, a repeated `custom_id`, too many lines, no lines): the batch fails, and its
  `errors` name the lines;
- one request is wrong (method, url, a body admission would refuse: unknown fields, `stream`, a
  model the key may not use or the stack does not serve, the request policy): that line gets an
  error-file entry with the 4xx answer the gateway would have given it online, and the rest run.

Pure: the caller reads the file and hands over the bytes, the key record and the settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serving.gateway.admission.admitter import model_allowed, requested_model, reservation_for
from serving.gateway.admission.body import BodyError, parse_json, request_document
from serving.gateway.admission.validation import check_request
from serving.gateway.auth.adapter_access import effective_patterns, served_to
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.batch.objects import LineError
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.protocol import errors

MAX_CUSTOM_ID = 512
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
MAX_REPORTED = 100  # file-level problems listed in `errors`; the first ones are enough to fix the file


@dataclass(frozen=True)
class Line:
    """A request that passed every check: `body` is what goes to `endpoint`."""

    number: int  # 1-based line number in the file
    custom_id: str
    body: bytes
    model: str = ""
    reserved: int = 0  # the tokens admission will reserve for it (line_reservation)


@dataclass(frozen=True)
class Rejected:
    """A request refused up front: `status` and `body` are the error answer it would get online."""

    number: int
    custom_id: str
    status: int
    body: dict[str, Any]

    @property
    def answer_bytes(self) -> int:
        """The size of its error body, as its answer keeps it until the batch ends."""
        return len(json.dumps(self.body, separators=(",", ":")))


@dataclass
class CheckedInput:
    lines: list[Line] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    problems: list[LineError] = field(default_factory=list)

    @property
    def custom_ids(self) -> list[str]:
        """Every request's custom_id in file order: the order of the output and error files."""
        numbered = [(x.number, x.custom_id) for x in self.lines] + [(x.number, x.custom_id) for x in self.rejected]
        return [custom_id for _, custom_id in sorted(numbered)]


def _answer(refusal: errors.Refusal) -> tuple[int, dict[str, Any]]:
    return refusal.status, refusal.document()


@dataclass(frozen=True)
class CheckedBody:
    raw: bytes
    model: str
    reserved: int


def line_reservation(document: dict[str, Any], body_size: int, endpoint: str, settings: GatewaySettings) -> int:
    """The tokens admission will reserve for this body when its line runs: the same function."""
    reservation, _ = reservation_for(document, body_size, endpoint, settings)
    return reservation.total


def check_body(
    body: Any, endpoint: str, key: KeyRecord, settings: GatewaySettings
) -> tuple[int, dict[str, Any]] | CheckedBody:
    """The body to send for one line, or the (status, error body) admission would answer it with."""
    if not isinstance(body, dict):
        return _answer(errors.invalid_request("body", "The line's body must be a JSON object.", "invalid_request_body"))
    raw = json.dumps(body, separators=(",", ":")).encode()
    document = request_document(raw, endpoint, settings)  # the same bounds as an online request's body
    if isinstance(document, BodyError):
        return _answer(errors.invalid_request(document.param, document.message, document.code))
    assert document is not None
    if document.get("stream") is True:
        return _answer(
            errors.invalid_request("stream", "A batch request cannot stream: leave out 'stream'.", "invalid_value")
        )
    model = requested_model(document)
    if not model_allowed(key, model, has_body=True, bases=settings.models):
        return _answer(errors.model_not_allowed(model))
    # The same test as online admission: a base, or an adapter the key's grants allow (`key` carries
    # its effective grants here); anything else, adapters it may not use included, is unknown.
    grants = effective_patterns(key.allowed_adapters, None)
    if model is None or served_to(model, settings.models, settings.model_adapters, grants) is None:
        return _answer(errors.model_not_found(str(model)))
    violation = check_request(document, endpoint, settings)
    if violation is not None:
        return _answer(errors.invalid_request(violation.param, violation.message, violation.code))
    return CheckedBody(raw, model, line_reservation(document, len(raw), endpoint, settings))


def check_input(content: bytes, endpoint: str, key: KeyRecord, settings: GatewaySettings) -> CheckedInput:
    checked = CheckedInput()
    seen: set[str] = set()
    limit = settings.max_body_bytes + 4096  # a body as large as an online one, plus the line's envelope

    def problem(code: str, message: str, number: int | None = None, param: str | None = None) -> None:
        if len(checked.problems) < MAX_REPORTED:
            checked.problems.append(LineError(code=code, message=message, line=number, param=param))

    try:
        text_lines = content.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        problem("invalid_file_format", "The input file is not UTF-8 text (JSONL: one JSON object per line).")
        return checked
    count = 0
    for number, text in enumerate(text_lines, start=1):
        if not text.strip():
            continue
        count += 1
        if count > settings.batch.max_lines:
            problem(
                "too_many_requests",
                f"The input file has more than {settings.batch.max_lines} requests (gateway.batch.max_lines).",
                number,
            )
            break
        line = parse_json(text.encode(), max_bytes=limit, max_depth=settings.max_json_depth + 1)
        if isinstance(line, BodyError) or not isinstance(line, dict):
            message = line.message if isinstance(line, BodyError) else "The line is not a JSON object."
            problem("invalid_json_line", message, number)
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            problem(
                "invalid_custom_id",
                f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters.",
                number,
                "custom_id",
            )
            continue
        if custom_id in seen:
            problem(
                "duplicate_custom_id",
                f"The custom_id {custom_id[:100]!r} is used by an earlier line: each request needs its own.",
                number,
                "custom_id",
            )
            continue
        seen.add(custom_id)
        outcome = _check_line(line, endpoint, key, settings)
        if isinstance(outcome, CheckedBody):
            checked.lines.append(Line(number, custom_id, outcome.raw, outcome.model, outcome.reserved))
        else:
            checked.rejected.append(Rejected(number, custom_id, *outcome))
    if count == 0 and not checked.problems:
        problem("empty_file", "The input file has no requests.")
    return checked


def _check_line(
    line: dict[str, Any], endpoint: str, key: KeyRecord, settings: GatewaySettings
) -> tuple[int, dict[str, Any]] | CheckedBody:
    unknown = sorted(set(line) - LINE_FIELDS)
    if unknown:
        return _answer(
            errors.invalid_request(
                unknown[0][:100],
                f"Unrecognized line field: {unknown[0][:100]}. A line has custom_id, method, url and body.",
                "unknown_parameter",
            )
        )
    if line.get("method") != "POST":
        return _answer(errors.invalid_request("method", "method must be POST.", "invalid_value"))
    if line.get("url") != endpoint:
        return _answer(errors.invalid_request("url", f"url must be the batch's endpoint, {endpoint}.", "invalid_url"))
    return check_body(line.get("body"), endpoint, key, settings)
