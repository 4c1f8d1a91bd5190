"""Build the tiny models a stack file points at, before anything plans or renders it.

The `local` stack loads tiny Llamas from `.cache/llmstack/models/<name>` and serves tiny LoRA
adapters from `.cache/llmstack/adapters/<name>` (`ops.devstack.tiny_adapter`); they are made here
on first use (`ops.devstack.tiny_model`) so that infra's planner and renderers only ever read
folders. A local source that is missing and is not a tiny model is left alone: the planner
then says which folder is missing.
"""

from __future__ import annotations

from pathlib import Path

from infra.spec.model_source import is_local_path, local_folder
from infra.spec.schema import DraftModelSpeculation, StackSpec


def local_sources(spec: StackSpec) -> list[str]:
    """Every local folder the stack loads: model sources and draft models."""
    sources = [m.source for m in spec.models]
    sources += [
        m.speculative_decoding.model for m in spec.models if isinstance(m.speculative_decoding, DraftModelSpeculation)
    ]
    return [s for s in sources if is_local_path(s)]


def local_adapter_sources(spec: StackSpec) -> list[str]:
    """Every local folder of a LoRA adapter the stack serves."""
    adapters = [a for m in spec.models if m.lora for a in m.lora.adapters]
    return [a.source for a in adapters if is_local_path(a.source)]


def ensure_local_models(spec: StackSpec) -> list[Path]:
    """Build each missing tiny model and tiny adapter the stack names; returns the folders built."""
    from ops.devstack import tiny_adapter
    from ops.devstack.tiny_model import RECIPES, ensure_tiny_model

    built = []
    for source in local_sources(spec):
        folder = local_folder(source)
        if not folder.exists() and folder.name in RECIPES:
            built.append(ensure_tiny_model(folder.parent, name=folder.name))
    for source in local_adapter_sources(spec):
        folder = local_folder(source)
        if not folder.exists() and tiny_adapter.recipe_for(folder.name) is not None:
            built.append(tiny_adapter.ensure_tiny_adapter(folder.parent, name=folder.name))
    return built
