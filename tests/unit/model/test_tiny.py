"""The tiny Qwen2 model directory: standard HF layout, deterministic weights, cached and atomic."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import beam_rl.model.tiny as tinymodel
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.model.tokenizer import load_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    return tmp_path


def test_builds_standard_layout_under_cache_env(cache):
    path = tiny_model_dir()
    assert path == cache / "models" / "tiny-qwen2-s0"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (128, 2, 128)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["hidden_size"] // config["num_attention_heads"] == 32  # smallest head size vLLM serves
    assert config["vocab_size"] == 512  # 512 tokens, already a multiple of 64
    assert config["max_position_embeddings"] == 1024
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2 and config["torch_dtype"] == "float32"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    # Tied: the checkpoint holds the embedding once, no lm_head copy.
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    # No staging directories left behind next to the published one.
    assert [p.name for p in path.parent.iterdir()] == ["tiny-qwen2-s0"]


def test_second_call_reuses_cache(cache, monkeypatch):
    first = tiny_model_dir()
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tinymodel, "_write_model", no_rebuild)
    assert tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_stale_recipe_is_rebuilt(cache):
    path = tiny_model_dir()
    (path / "beam_rl_recipe.json").write_text(json.dumps({"recipe_version": -1, "seed": 0}))
    assert tiny_model_dir() == path
    assert json.loads((path / "beam_rl_recipe.json").read_text())["recipe_version"] == tinymodel.RECIPE_VERSION
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-qwen2-s0"]


def test_weights_are_a_function_of_the_seed(tmp_path):
    rng_before = torch.get_rng_state()
    a = load_file(str(tiny_model_dir(0, cache_dir=tmp_path / "a") / "model.safetensors"))
    b = load_file(str(tiny_model_dir(0, cache_dir=tmp_path / "b") / "model.safetensors"))
    c = load_file(str(tiny_model_dir(1, cache_dir=tmp_path / "a") / "model.safetensors"))
    assert torch.equal(torch.get_rng_state(), rng_before)  # building does not consume the global RNG
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_load_tiny_model_runs_forward(tmp_path):
    path = tiny_model_dir(cache_dir=tmp_path)
    model = load_tiny_model(path)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = load_tokenizer(str(path))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3 + 4?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert torch.isfinite(logits).all()
