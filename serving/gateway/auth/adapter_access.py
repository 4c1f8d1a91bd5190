"""LoRA adapters: which client-facing model names a stack serves, and which of them a key may use
(pure code: no I/O).

A stack serves adapters on a base model (`model_adapters` in the gateway's settings: base name ->
adapter ids); a client names one as `<base>:<adapter>`, Ray Serve LLM's convention (ray 2.60,
`ray/llm/_internal/common/utils/lora_utils.py`: the base is the text before the first `:`, the
adapter everything after it, and the adapter's files are read from
`<dynamic_lora_loading_path>/<adapter>`). The gateway forwards that name unchanged to the base's
Serve application, which loads the adapter on demand.

Because Ray would try to load whatever follows the first `:` (`tiny-chat:../x`, `tiny-chat:a:b`),
the gateway never parses a requested name leniently: a name is served only when it is *exactly*
one the stack enumerates (a base, or `<base>:<adapter>` built from the settings), compared as
strings. Case, whitespace, unicode lookalikes, extra colons and glob characters in a request
match nothing and are refused like any unknown model.

Who may use an adapter: patterns (fnmatch-style, case-sensitive: `*`, `?`, `[...]`) matched
against the full client-facing name `<base>:<adapter>`, so `tiny-chat:*` is every adapter of
`tiny-chat`, `*:sql` the adapter `sql` on any base, `tiny-chat:sql` just that one. A pattern is
only ever matched against the stack's own served names, never against a requested name. A key's
effective patterns are its own list when it has one (even an empty one), else its tenant's; no
list anywhere means no adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from serving.gateway.config.settings import ADAPTER_SEPARATOR

# A grant: `<base pattern>:<adapter pattern>`, glob characters allowed on either side.
ADAPTER_PATTERN = re.compile(r"[A-Za-z0-9._/*?\[\]!-]{1,256}:[A-Za-z0-9._*?\[\]!-]{1,128}")


def adapter_name(base: str, adapter: str) -> str:
    """The client-facing name of `adapter` served on `base`."""
    return f"{base}{ADAPTER_SEPARATOR}{adapter}"


def base_of(name: str, bases: Iterable[str]) -> str:
    """The base model a requested name addresses, by Ray's rule (text before the first `:`) when
    that is a served base, else the name itself. Used for decisions that must not depend on
    whether the adapter exists (the key's model list, routing of what is forwarded)."""
    head = name.split(ADAPTER_SEPARATOR, 1)[0]
    return head if head in frozenset(bases) else name


@dataclass(frozen=True)
class ServedModel:
    """A name the stack serves: `name` exactly as the client wrote it (and as it goes upstream),
    `base` the model whose replicas serve it (route, queue, capacity, context length, rate), and
    `adapter` the adapter id, None for a base model."""

    name: str
    base: str
    adapter: str | None = None


def served_adapters(model_adapters: Mapping[str, Sequence[str]]) -> dict[str, ServedModel]:
    """Every adapter the stack serves, by client-facing name."""
    return {
        adapter_name(base, adapter): ServedModel(adapter_name(base, adapter), base, adapter)
        for base, adapters in model_adapters.items()
        for adapter in adapters
    }


def may_use(patterns: Sequence[str], name: str) -> bool:
    """Whether a served adapter's client-facing `name` matches one of the granted `patterns`."""
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def effective_patterns(key_patterns: Sequence[str] | None, tenant_patterns: Sequence[str] | None) -> list[str]:
    """The key's own list when it has one (an empty list included: no adapters), else its tenant's."""
    if key_patterns is not None:
        return list(key_patterns)
    return list(tenant_patterns or ())


def served_to(
    name: str, models: Sequence[str], model_adapters: Mapping[str, Sequence[str]], patterns: Sequence[str]
) -> ServedModel | None:
    """What `name` is for a caller holding `patterns`: a served base, an adapter it may use, or
    None (unknown, or an adapter it may not use: the caller cannot tell which)."""
    if name in models:
        return ServedModel(name, name)
    adapter = served_adapters(model_adapters).get(name)
    if adapter is None or adapter.base not in models or not may_use(patterns, adapter.name):
        return None
    return adapter


def visible_adapters(
    bases: Iterable[str], model_adapters: Mapping[str, Sequence[str]], patterns: Sequence[str]
) -> list[ServedModel]:
    """The adapters of `bases` a caller holding `patterns` may use, in the stack's order."""
    wanted = frozenset(bases)
    return [
        adapter
        for adapter in served_adapters(model_adapters).values()
        if adapter.base in wanted and may_use(patterns, adapter.name)
    ]


def checked_patterns(patterns: Sequence[str]) -> list[str]:
    """Grants as an operator typed them, or ValueError saying what a grant looks like."""
    for pattern in patterns:
        if not ADAPTER_PATTERN.fullmatch(pattern):
            raise ValueError(
                f"adapter grant {pattern!r} must be <base>:<adapter>, either side a name or an fnmatch "
                "pattern (* ? [...]), e.g. tiny-chat:sql, tiny-chat:*, *:support-*"
            )
    return list(dict.fromkeys(patterns))
