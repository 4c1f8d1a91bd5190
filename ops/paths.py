"""Where llmstack keeps files on this machine, named once.

`.cache/llmstack/` in the checkout holds everything `make dev` makes: the tiny models, the dev
lock, the LiteLLM venv of the gateway benchmark (the Makefile's LITELLM). `$LLMSTACK_CACHE_DIR`
moves the tiny models' default folder (the stack file still names where the local stack loads
them from); `$LLMSTACK_STATE_DIR` moves the dev lock, so tests never collide with a developer's
running `make dev`.
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.spec.stack_file import PROJECT_ROOT

CACHE_DIR = PROJECT_ROOT / ".cache" / "llmstack"


def tiny_models_dir() -> Path:
    """Default folder for the tiny local models: `$LLMSTACK_CACHE_DIR`, else `.cache/llmstack/models`."""
    env = os.environ.get("LLMSTACK_CACHE_DIR")
    return Path(env) if env else CACHE_DIR / "models"


def state_dir() -> Path:
    """Folder of the `make dev` lock: `$LLMSTACK_STATE_DIR`, else `.cache/llmstack`."""
    env = os.environ.get("LLMSTACK_STATE_DIR")
    return Path(env) if env else CACHE_DIR


def user_cache_dir() -> Path:
    """Per-user cache shared by every checkout (XDG): `llmctl models sync` keeps file hashes here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmstack"
