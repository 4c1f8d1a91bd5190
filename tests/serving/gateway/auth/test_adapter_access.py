"""Which names a stack serves to a caller, and which adapters its grants allow (pure decisions)."""

from __future__ import annotations

import pytest

from serving.gateway.auth.adapter_access import (
    ServedModel,
    base_of,
    checked_patterns,
    effective_patterns,
    may_use,
    served_to,
    visible_adapters,
)

MODELS = ["tiny-chat", "other"]
ADAPTERS = {"tiny-chat": ["sql", "pirate"], "other": ["sql"]}


def test_a_base_is_served_to_everyone_and_routes_to_itself() -> None:
    assert served_to("tiny-chat", MODELS, ADAPTERS, []) == ServedModel("tiny-chat", "tiny-chat")


def test_an_adapter_is_served_only_to_callers_granted_it_and_routes_to_its_base() -> None:
    assert served_to("tiny-chat:sql", MODELS, ADAPTERS, ["tiny-chat:sql"]) == ServedModel(
        "tiny-chat:sql", "tiny-chat", "sql"
    )
    assert served_to("tiny-chat:pirate", MODELS, ADAPTERS, ["tiny-chat:sql"]) is None
    assert served_to("tiny-chat:sql", MODELS, ADAPTERS, []) is None


@pytest.mark.parametrize(
    "name",
    [
        "tiny-chat:nope",  # not served
        "other:pirate",  # served on another base only
        "TINY-CHAT:sql",
        "tiny-chat:SQL",
        " tiny-chat:sql",
        "tiny-chat:sql ",
        "tiny-chat:sql\n",
        "tiny-chat\u200b:sql",  # zero-width space
        "t\u0456ny-chat:sql",  # Cyrillic i
        "tiny-chat\uff1asql",  # fullwidth colon
        "tiny-chat:sql:x",
        "tiny-chat::sql",
        "tiny-chat:*",
        "tiny-chat:s?l",
        "*:sql",
        "tiny-chat:../sql",
        "tiny-chat:sql/",
        "",
    ],
)
def test_no_other_spelling_is_served_even_to_a_caller_granted_everything(name: str) -> None:
    assert served_to(name, MODELS, ADAPTERS, ["*:*"]) is None


def test_grants_are_globs_on_the_full_name_and_case_sensitive() -> None:
    assert may_use(["tiny-chat:*"], "tiny-chat:sql")
    assert may_use(["*:sql"], "other:sql")
    assert not may_use(["*:sql"], "tiny-chat:pirate")
    assert not may_use(["Tiny-Chat:*"], "tiny-chat:sql")
    assert not may_use(["sql"], "tiny-chat:sql")  # a bare id matches nothing (and is refused when set)


def test_the_keys_list_wins_even_empty_else_the_tenants() -> None:
    assert effective_patterns(["a:b"], ["c:d"]) == ["a:b"]
    assert effective_patterns([], ["c:d"]) == []
    assert effective_patterns(None, ["c:d"]) == ["c:d"]
    assert effective_patterns(None, None) == []


def test_visible_adapters_are_exactly_the_granted_ones_of_the_given_bases() -> None:
    names = [a.name for a in visible_adapters(MODELS, ADAPTERS, ["*:sql"])]
    assert names == ["tiny-chat:sql", "other:sql"]
    assert [a.name for a in visible_adapters(["other"], ADAPTERS, ["*:*"])] == ["other:sql"]
    assert visible_adapters(MODELS, ADAPTERS, []) == []


def test_base_of_follows_rays_rule_only_for_served_bases() -> None:
    assert base_of("tiny-chat:anything:at:all", MODELS) == "tiny-chat"
    assert base_of("unknown:sql", MODELS) == "unknown:sql"
    assert base_of("tiny-chat", MODELS) == "tiny-chat"


def test_grants_are_checked_when_set() -> None:
    assert checked_patterns(["tiny-chat:sql", "tiny-chat:*", "tiny-chat:sql"]) == ["tiny-chat:sql", "tiny-chat:*"]
    for bad in ("sql", "tiny-chat:", ":sql", "a:b:c", "tiny chat:sql", "tiny-chat:sql/x"):
        with pytest.raises(ValueError, match="must be <base>:<adapter>"):
            checked_patterns([bad])
