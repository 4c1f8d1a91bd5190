"""Media URLs in chat messages: inline `data:` URLs only, unless the stack names the domains a
model may fetch media from.

vLLM fetches every http(s) URL it finds in an image, audio or video part, from inside the
cluster's network: a URL sent as is would let a caller make the engine read the instance
metadata service (`http://169.254.169.254/...`) or any internal address. So the gateway looks
at every place vLLM reads a media URL from (vllm/renderers/chat_utils.py, `MM_PARSER_MAP` and
the untyped and `uuid` forms of `_parse_chat_message_content_mm_part`: the keys `image_url`,
`audio_url`, `video_url`, as a string or an object's `url`), in every message, at any depth,
whatever the part's `type` says (with a `uuid`, vLLM ignores the type and goes by the keys),
plus OpenAI's `file` part fields. `input_audio` becomes a `data:` URL in vLLM itself.

A URL passes when vLLM itself would read it as inline data (`url[:5].lower() == "data:"`,
vLLM's own test, so both read the same string the same way), or when it is exactly
`http(s)://<host>[:port][/path...]` in lower case, printable ASCII, no user info, and `<host>` is
one of the allowed domains, as urllib3's `parse_url` (vLLM's parser) also reads it. Everything
else (another scheme, upper case, spaces, `//host`, `user@host`, IP addresses in any spelling,
backslashes) is refused with 400 before any quota is charged. The engine enforces the same list
(`--allowed-media-domains`, rendered by infra.render.serve_config) and follows no redirects.
The body the gateway checked is the body the engine gets (repeated keys are refused at parse).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from serving.gateway.admission.validation import PolicyViolation

MEDIA_URL_REFUSED = "media_url_not_allowed"
INVALID_TYPE = "invalid_type"

# Keys whose value vLLM fetches (a URL string, or an object with a `url`), and OpenAI's file fields.
URL_KEYS = frozenset({"image_url", "audio_url", "video_url"})
FILE_KEYS = frozenset({"file_data", "file_url"})

_HTTP_URL = re.compile(r"(?P<scheme>https?)://(?P<host>[a-z0-9.-]+)(?::[0-9]{1,5})?(?:[/?#][\x21-\x5b\x5d-\x7e]*)?")


def is_inline(url: str) -> bool:
    """vLLM's own test for inline media (MediaConnector.load_from_url)."""
    return url[:5].lower() == "data:"


def allowed_remote(url: str, domains: Collection[str]) -> bool:
    """An http(s) URL on one of `domains`, read the same way by this pattern and by urllib3."""
    match = _HTTP_URL.fullmatch(url)
    if match is None or match["host"] not in domains:
        return False
    try:
        parsed = parse_url(url)
    except LocationParseError:
        return False
    return parsed.scheme == match["scheme"] and parsed.host == match["host"] and parsed.auth is None


def media_values(messages: list[Any]) -> Iterator[tuple[str, Any]]:
    """(where, value) of every value vLLM would fetch as media, anywhere under `messages`."""
    pending: list[tuple[str, Any]] = [("messages", messages)]
    while pending:  # no recursion: the depth is bounded by the parse, but a loop needs no bound
        where, node = pending.pop()
        if isinstance(node, list):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(node))
        elif isinstance(node, dict):
            for key, value in node.items():
                path = f"{where}.{key}"
                if key in URL_KEYS:
                    yield (path, value) if not isinstance(value, dict) else (f"{path}.url", value.get("url"))
                elif key in FILE_KEYS:
                    yield path, value
                pending.append((path, value))


def check_media(document: dict[str, Any], domains: Collection[str]) -> PolicyViolation | None:
    """The first media URL in `document`'s messages that may not be fetched, or None."""
    messages = document.get("messages")
    if not isinstance(messages, list):
        return None
    for where, value in media_values(messages):
        if value is None:
            continue
        if not isinstance(value, str):
            return PolicyViolation(where[:200], f"'{where[:200]}' must be a URL string.", INVALID_TYPE)
        if is_inline(value) or allowed_remote(value, domains):
            continue
        if not domains:
            return PolicyViolation(
                where[:200],
                f"'{where[:200]}' must be a data: URL (base64 media inline): this "
                "gateway's models fetch no media from the network.",
                MEDIA_URL_REFUSED,
            )
        return PolicyViolation(
            where[:200],
            f"'{where[:200]}' must be a data: URL, or an http(s) URL on one of "
            f"{sorted(domains)} written plainly (lower case, no user info).",
            MEDIA_URL_REFUSED,
        )
    return None
