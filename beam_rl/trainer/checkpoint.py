"""Publishing the policy's weights into the run directory, and the trainer's own resume state (optimizer
moments). Whether a checkpoint fits the served model is beam_rl.rundir.checkpoint_shapes."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from beam_rl.rundir import STABLE_FILE, RunDir, write_atomic

# Weight files of a source model directory: never copied next to the published weights, where a
# second set of tensors (or a stale shard index) would make a loader read the wrong ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_OPTIMIZER_FILE = re.compile(r"^optimizer_step_(\d+)\.pt$")
TRAINER_STATE_DIR = "trainer"


def publish_weights(
    run_dir: RunDir, step: int, model: torch.nn.Module, source_dir: str | os.PathLike | None = None
) -> Path:
    """Save `model` as weights/step_<step>/ (safetensors, Hugging Face layout) + STABLE, atomically; returns the dir.

    Config, generation config, tokenizer and chat template are copied from `source_dir` (default: the
    directory the model was loaded from) over what save_pretrained writes, so the published directory
    loads in vLLM exactly like the original one (same config spellings, same serving dtype).
    Weights are saved in the training dtype (float32 here); vLLM casts on load.
    A peft model publishes its adapter alone (adapter_config.json, adapter_model.safetensors), which servers
    load as a LoRA adapter over the model they serve.
    """
    source = Path(source_dir if source_dir is not None else str(model.name_or_path))
    adapter = hasattr(model, "peft_config")
    with run_dir.publish_weights_dir(step) as directory:
        with quiet_progress_bars():
            model.save_pretrained(str(directory))  # type: ignore[operator]  # a transformers or peft model
        if source.is_dir() and not adapter:
            for path in sorted(source.iterdir()):
                if _is_model_side_file(path):
                    shutil.copyfile(path, directory / path.name)
    return run_dir.weights_path(step)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar on stderr per load and save; a trainer prints only when asked."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _is_model_side_file(path: Path) -> bool:
    name = path.name
    if not path.is_file() or name.startswith(".") or name == STABLE_FILE:
        return False
    return not (name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"))


# -- the trainer's resume state: run_dir/trainer/optimizer_step_<N>.pt ---------------------------------


def optimizer_state_path(run_dir: RunDir, step: int) -> Path:
    return run_dir.path / TRAINER_STATE_DIR / f"optimizer_step_{step}.pt"


def save_optimizer_state(run_dir: RunDir, step: int, optimizer: torch.optim.Optimizer) -> Path:
    """Written before the step's weights are published, so stable weights always have their optimizer state."""
    path = optimizer_state_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    write_atomic(path, buffer.getvalue())
    return path


def load_optimizer_state(run_dir: RunDir, step: int, optimizer: torch.optim.Optimizer) -> bool:
    """Restore the optimizer saved with step `step`'s weights; False (optimizer left fresh) if there is none."""
    path = optimizer_state_path(run_dir, step)
    if not path.is_file():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True


def prune_optimizer_states(run_dir: RunDir, keep_step: int) -> None:
    """Remove optimizer states older than `keep_step` (only the latest stable step's is ever resumed from)."""
    directory = run_dir.path / TRAINER_STATE_DIR
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = _OPTIMIZER_FILE.match(path.name)
        if match and int(match.group(1)) < keep_step:
            path.unlink(missing_ok=True)
