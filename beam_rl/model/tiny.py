"""A tiny random-init Qwen2 causal LM in standard Hugging Face layout, built offline and cached.

It stands in for a real policy in tests and local runs: same architecture, loaders and checkpoint
format as a real Qwen2 (so real vLLM can serve it), a few hundred thousand parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from beam_rl.cache import cache_root
from beam_rl.model.tokenizer import build_tiny_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Qwen2Config

# Bump when the recipe below changes, so stale cached directories are rebuilt, not reused.
RECIPE_VERSION = 1
_RECIPE_FILE = "beam_rl_recipe.json"

# head_dim = hidden / heads = 32: vLLM's attention kernels (CPU and FlashAttention) accept head
# sizes from 32 up, and vLLM's Qwen2 derives head_dim from hidden_size, so 64/4 = 16 would not load.
TINY_ARCH = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
ROPE_THETA = 10000.0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _tiny_config(vocab_size: int, eos_id: int, pad_id: int, arch: dict[str, Any]) -> Qwen2Config:
    from transformers import Qwen2Config

    return Qwen2Config(  # type: ignore[call-arg]  # rope_theta: taken through **kwargs by newer releases
        vocab_size=vocab_size,
        bos_token_id=pad_id,  # Qwen convention: <|endoftext|> doubles as bos
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rope_theta=ROPE_THETA,
        **arch,
    )


def _write_model(
    directory: pathlib.Path, seed: int, arch: dict[str, Any] = TINY_ARCH, device: str = "cpu", dtype: str = "float32"
) -> None:
    # torch and transformers' models only here: the orchestrator finds the model cached and never
    # imports them (seconds of start-up, and torch._dynamo's import of triton).
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(_round_up(len(tokenizer), 64), tokenizer.eos_token_id, tokenizer.pad_token_id, arch)
    # fork_rng: a fixed seed for the weights without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(str(directory), safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    # transformers 5 writes `dtype` and `rope_parameters`; older readers (vLLM on transformers 4.x)
    # look for `torch_dtype` and `rope_theta`, so write both spellings.
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    saved.setdefault("torch_dtype", dtype)
    saved.setdefault("rope_theta", ROPE_THETA)
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    (directory / _RECIPE_FILE).write_text(json.dumps({"recipe_version": RECIPE_VERSION, "seed": seed}) + "\n")


def _is_current(directory: pathlib.Path, seed: int) -> bool:
    try:
        recipe = json.loads((directory / _RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recipe == {"recipe_version": RECIPE_VERSION, "seed": seed}


def tiny_model_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory of the tiny model for `seed`, built once and cached (atomically published).

    `cache_dir` overrides the cache root (default: `cache_root()`).
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "models" / f"tiny-qwen2-s{seed}"
    if _is_current(final, seed):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the final path (same filesystem) and rename: readers never see a half-written
    # model, and concurrent builders (pytest-xdist, several workers) do not corrupt each other.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_model(staging, seed)
        # mkdtemp and safetensors create owner-only modes; a shared cache must be readable by all.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if final.exists():  # stale recipe, or a concurrent builder won the race
            if _is_current(final, seed):
                return final
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.rename(final, trash / "model")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(staging, final)
        except OSError:
            if not _is_current(final, seed):  # lost a race to a builder of the same recipe otherwise
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def write_random_qwen2(
    directory: str | os.PathLike, arch: dict[str, Any], seed: int = 0, device: str = "cpu", dtype: str = "float32"
) -> pathlib.Path:
    """A random-init Qwen2 of any size `arch` (TINY_ARCH's keys) with the tiny tokenizer at `directory`, initialised
    on `device` (a GPU builds a 0.5B model in seconds) and saved in `dtype`. Not cached: for checks and benchmarks
    that need a bigger model of the tiny one's architecture and vocabulary."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_model(directory, seed, arch, device, dtype)
    return directory


def write_llama_model(
    directory: str | os.PathLike, hidden_size: int = 64, num_hidden_layers: int = 2, seed: int = 0
) -> pathlib.Path:
    """A Llama-shaped causal LM with random weights and the tiny tokenizer at `directory`: another architecture
    than the tiny Qwen2 (no attention biases, untied embeddings), for runs and benchmarks that must not depend on
    one model class. Heads of 32 (the smallest vLLM's kernels take), half as many key/value heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = pathlib.Path(directory)
    tokenizer = build_tiny_tokenizer()
    heads = max(1, hidden_size // 32)
    config = LlamaConfig(
        vocab_size=_round_up(len(tokenizer), 64),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(str(directory))
    save_tokenizer(tokenizer, directory)
    return directory


def load_tiny_model(path: str | os.PathLike) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    """A causal LM from a local directory, float32 on CPU, in eval mode."""
    # No dtype argument: its name changed across transformers releases (torch_dtype -> dtype).
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model.to(device="cpu", dtype=torch.float32).eval()  # type: ignore[call-arg]  # transformers' own wrapper
