"""The tiny LoRA adapters: the two named ones `make dev` serves stay as they are, and any number of
numbered ones are made from fixed seeds of their own (the many-adapter benchmark serves twenty)."""

from __future__ import annotations

import hashlib

import pytest

from ops.devstack.tiny_adapter import RECIPES, TinyAdapterRecipe, ensure_tiny_adapter, numbered_adapter, recipe_for


def weights_digest(folder) -> str:
    return hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_named_adapters_keep_their_recipes_and_numbered_ones_get_seeds_of_their_own():
    assert recipe_for("tiny-llama-sql") == TinyAdapterRecipe(seed=1)
    assert recipe_for("tiny-llama-pirate") == RECIPES["tiny-llama-pirate"]
    names = [numbered_adapter(i) for i in range(1, 21)]
    assert names[0] == "tiny-llama-a01" and names[-1] == "tiny-llama-a20"
    recipes = [recipe_for(name) for name in names]
    assert all(r is not None and r.rank == 8 for r in recipes)
    seeds = {r.seed for r in recipes if r is not None}
    assert len(seeds) == 20 and not seeds & {r.seed for r in RECIPES.values()}
    assert recipe_for("tiny-llama-a20") == recipe_for("tiny-llama-a20")  # fixed, not drawn per call
    assert recipe_for("tiny-llama-a100") is not None
    for unknown in ("tiny-llama-a00", "tiny-llama-a1", "tiny-llama-ax1", "llama-a01"):
        assert recipe_for(unknown) is None, unknown
    with pytest.raises(ValueError):
        numbered_adapter(0)


def test_numbered_adapters_are_built_deterministic_and_distinct(tmp_path):
    first = ensure_tiny_adapter(tmp_path / "one", name="tiny-llama-a03")
    again = ensure_tiny_adapter(tmp_path / "two", name="tiny-llama-a03")
    other = ensure_tiny_adapter(tmp_path / "one", name="tiny-llama-a04")
    assert first.name == "tiny-llama-a03" and (first / "adapter_config.json").is_file()
    assert weights_digest(first) == weights_digest(again)
    assert weights_digest(first) != weights_digest(other)
    with pytest.raises(ValueError, match="unknown tiny adapter"):
        ensure_tiny_adapter(tmp_path, name="tiny-llama-b01")
