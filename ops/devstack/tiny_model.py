"""Make a tiny, real Llama model folder on first run: offline, deterministic, cached.

Why: the local and CI serving path (CPU vLLM under Ray Serve) should load a model through
exactly the code a production checkpoint goes through (config.json, safetensors, a fast
tokenizer, a chat template), yet `make dev` and CI must never download anything. So we
train a byte-level BPE on a text shipped in the repo and save randomly initialised Llama
weights from a fixed seed. The answers are noise; every part around the model is real.

Torch, transformers and tokenizers are imported inside functions so that importing this
module (for example from the gateway image, which has none of them) stays cheap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ops.devstack.cached_build import ensure_built
from ops.paths import tiny_models_dir

CORPUS_PATH = Path(__file__).parent / "data" / "tiny_corpus.txt"
# Bump when the build code changes in a way the recipe hash cannot see.
BUILD_VERSION = "1"

BOS, EOS_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS_TEXT, "<|start_header_id|>", "<|end_header_id|>", EOT)

# Llama-3 style: every turn ends with <|eot_id|>, which is also what generation stops on.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


class TinyModelRecipe(BaseModel):
    """Everything that determines the bytes of a tiny model folder.

    Shape fields are named as in `transformers.LlamaConfig` and passed through unchanged.
    CPU vLLM attention rejects head_dim=16, so heads stay 64 wide and the model is made
    small by having few of them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(256, gt=0, description="Width of the residual stream.")
    num_attention_heads: int = Field(4, gt=0, description="Query heads per layer.")
    num_key_value_heads: int = Field(2, gt=0, description="KV heads (grouped-query attention).")
    head_dim: int = Field(64, gt=0, description="Per-head width; 64 is verified on CPU vLLM.")
    num_hidden_layers: int = Field(2, gt=0, description="Decoder layers.")
    intermediate_size: int = Field(512, gt=0, description="MLP hidden width.")
    vocab_size: int = Field(
        2048,
        gt=len(SPECIAL_TOKENS) + 256,
        description="BPE training target; the model uses the size actually reached, "
        "so models sharing this value and the corpus share one vocabulary.",
    )
    max_position_embeddings: int = Field(2048, gt=0, description="Longest context.")
    seed: int = Field(0, description="torch seed for the weight initialisation.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="Saved weight dtype; bfloat16 crashes CPU vLLM on our machines."
    )


RECIPES: dict[str, TinyModelRecipe] = {
    "tiny-llama": TinyModelRecipe(),
    # A speculative-decoding draft: same tokenizer (same corpus and vocab target), 1 layer.
    "tiny-llama-draft": TinyModelRecipe(num_hidden_layers=1),
}


def recipe_hash(recipe: TinyModelRecipe) -> str:
    """Hash of every input to the build, so a changed recipe, corpus or template rebuilds."""
    h = hashlib.sha256()
    for part in (BUILD_VERSION, recipe.model_dump_json(), CHAT_TEMPLATE, *SPECIAL_TOKENS):
        h.update(part.encode() + b"\0")
    h.update(CORPUS_PATH.read_bytes())
    return h.hexdigest()


def ensure_tiny_model(
    cache_dir: Path | None = None,
    *,
    name: str = "tiny-llama",
    recipe: TinyModelRecipe | None = None,
) -> Path:
    """Return `<cache_dir>/<name>`, building it first unless a matching marker says it is done.

    `recipe` defaults to `RECIPES[name]`. The folder is built in a hidden temp folder next
    to the target, the marker is written last and the folder renamed into place, so an
    interrupted run never leaves a folder that looks complete. Concurrent builders are
    harmless: the bytes are deterministic and the first rename wins.
    """
    if recipe is None:
        if name not in RECIPES:
            raise ValueError(
                f"unknown tiny model {name!r}; known: {sorted(RECIPES)} (or pass recipe=TinyModelRecipe(...))"
            )
        recipe = RECIPES[name]
    cache_dir = Path(cache_dir) if cache_dir is not None else tiny_models_dir()
    return ensure_built(cache_dir / name, recipe_hash(recipe), lambda folder: _build(folder, recipe))


def _build(out: Path, recipe: TinyModelRecipe) -> None:
    tokenizer = _train_tokenizer(recipe)
    tokenizer.save_pretrained(out)
    _write_portable_tokenizer_files(out)
    _save_weights(out, recipe, tokenizer)
    for path in (out, *out.iterdir()):  # mkdtemp makes 0700; the cache may be shared
        path.chmod(0o755 if path.is_dir() else 0o644)


def _train_tokenizer(recipe: TinyModelRecipe):
    """Byte-level BPE on the shipped corpus, wrapped as a transformers fast tokenizer.

    Byte level means any input string encodes (no unknown token), which keeps the gateway
    and the engine honest about arbitrary user text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_PATH.read_text().splitlines(keepends=True), trainer=trainer)
    # Like Llama 3: plain encodes start with BOS (chat prompts get it from the template).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,  # chat turns end here; generation_config also lists <|end_of_text|>
        pad_token=EOS_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_position_embeddings,
    )


def _write_portable_tokenizer_files(out: Path) -> None:
    """Also write the tokenizer the transformers 4 way.

    transformers 5 puts the template in chat_template.jinja, names its own backend class
    and writes no special_tokens_map.json; readers pinned to transformers 4 look for the
    template in tokenizer_config.json and for the 4.x class name. Both versions agree then.
    """
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOT, "pad_token": EOS_TEXT}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _save_weights(out: Path, recipe: TinyModelRecipe, tokenizer) -> None:
    """Random Llama weights from a fixed seed; the global torch RNG is left untouched."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS_TEXT, EOT)}
    stop_ids = [ids[EOT], ids[EOS_TEXT]]
    config = LlamaConfig(
        **recipe.model_dump(exclude={"vocab_size", "seed", "dtype"}),
        vocab_size=len(tokenizer),  # what BPE reached, so no id decodes to nothing
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=stop_ids,
        pad_token_id=ids[EOS_TEXT],
        dtype=recipe.dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config).to(getattr(torch, recipe.dtype))
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=stop_ids, pad_token_id=ids[EOS_TEXT])
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) and print a tiny model folder.")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="cache folder to put it in (default: $LLMSTACK_CACHE_DIR, else <repo>/.cache/llmstack/models)",
    )
    parser.add_argument("--name", choices=sorted(RECIPES), default="tiny-llama")
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.out, name=args.name))


if __name__ == "__main__":
    main()
