"""The tiny local model: built offline, deterministic, cached, and loadable by transformers."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it

import pytest
from pydantic import ValidationError

from infra.spec.stack_file import PROJECT_ROOT
from ops.devstack.cached_build import MARKER_NAME
from ops.devstack.tiny_model import (
    RECIPES,
    TinyModelRecipe,
    ensure_tiny_model,
)
from ops.paths import tiny_models_dir

REPO_ROOT = PROJECT_ROOT
USER_TURN = [{"role": "user", "content": "What is a KV cache?"}]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_dir(cache_dir) -> Path:
    return ensure_tiny_model(cache_dir)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_folder_has_every_file_a_loader_needs(model_dir, cache_dir):
    assert model_dir == cache_dir / "tiny-llama"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        MARKER_NAME,
    ):
        assert (model_dir / name).is_file(), name
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")], "temp folder left behind"


def test_config_has_shapes_cpu_vllm_accepts(model_dir, tokenizer):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64
    assert config["num_key_value_heads"] == 2
    assert config["num_attention_heads"] == 4
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 256
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert config["vocab_size"] == len(tokenizer)


def test_generation_stops_on_end_of_turn_and_end_of_text(model_dir, tokenizer):
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eot, end_of_text = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert set(generation["eos_token_id"]) == {eot, end_of_text}
    assert tokenizer.eos_token == "<|eot_id|>"


def test_chat_template_renders_llama3_turns(tokenizer):
    text = tokenizer.apply_chat_template(USER_TURN, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is a KV cache?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = tokenizer.apply_chat_template(USER_TURN, tokenize=False, add_generation_prompt=False)
    assert without.endswith("<|eot_id|>")


def test_tokenizer_round_trips_any_text(tokenizer):
    text = "Rate limits protect the service. Ünïcödé and emoji 🙂 too!"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_weights_load_and_run(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer("Batching keeps the machine busy.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))


def test_second_call_reuses_the_folder(model_dir, cache_dir):
    before = (model_dir / MARKER_NAME).stat().st_mtime_ns
    assert ensure_tiny_model(cache_dir) == model_dir
    assert (model_dir / MARKER_NAME).stat().st_mtime_ns == before


def test_same_seed_gives_identical_bytes(model_dir, tmp_path):
    again = ensure_tiny_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(model_dir / name), name


def test_draft_shares_the_vocabulary(model_dir, cache_dir):
    draft = ensure_tiny_model(cache_dir, name="tiny-llama-draft")
    assert draft == cache_dir / "tiny-llama-draft"
    assert _sha256(draft / "tokenizer.json") == _sha256(model_dir / "tokenizer.json")
    main_config = json.loads((model_dir / "config.json").read_text())
    draft_config = json.loads((draft / "config.json").read_text())
    assert draft_config["num_hidden_layers"] == 1
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "head_dim"):
        assert draft_config[key] == main_config[key], key


def test_stale_marker_rebuilds_in_place(tmp_path):
    folder = ensure_tiny_model(tmp_path)
    (folder / MARKER_NAME).write_text("recipe from an older version\n")
    (folder / "leftover.bin").write_bytes(b"x")
    assert ensure_tiny_model(tmp_path) == folder
    assert not (folder / "leftover.bin").exists()
    assert (folder / MARKER_NAME).read_text() != "recipe from an older version\n"


def test_custom_recipe_and_unknown_name():
    with pytest.raises(ValueError, match="tiny-llama-draft"):
        ensure_tiny_model(Path("/nonexistent"), name="no-such-model")
    with pytest.raises(ValidationError, match="frozen"):  # a recipe cannot drift after it is hashed
        RECIPES["tiny-llama"].num_hidden_layers = 3
    assert TinyModelRecipe().head_dim == 64


def test_default_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSTACK_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert tiny_models_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("LLMSTACK_CACHE_DIR")
    assert tiny_models_dir() == REPO_ROOT / ".cache" / "llmstack" / "models"


def test_import_is_cheap():
    """The gateway image imports serving modules without torch or transformers installed."""
    code = (
        "import sys, ops.devstack.tiny_model; print(sorted({'torch', 'transformers', 'tokenizers'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_cli_prints_the_folder(model_dir, cache_dir):
    out = subprocess.run(
        [sys.executable, "-m", "ops.devstack.tiny_model", "--out", str(cache_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str(model_dir)
