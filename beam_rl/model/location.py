"""Where a run's policy model lives, and what the rest of the run reads from its files."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from beam_rl.config import RunConfig
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.model.tokenizer import load_tokenizer


@functools.lru_cache(maxsize=4)
def tokenizer_for(model_name: str) -> Any:
    return load_tokenizer(model_name)


def model_dir(config: RunConfig) -> Path:
    """The Hugging Face directory of the policy model (the tiny one is built offline on first use)."""
    if config.model.name == "tiny":
        return tiny_model_dir(config.run.seed)
    return Path(config.model.name)


def vocab_size(config: RunConfig) -> int:
    """The model's output width (what -log(V) in the gibberish rule refers to)."""
    return int(json.loads((model_dir(config) / "config.json").read_text())["vocab_size"])
