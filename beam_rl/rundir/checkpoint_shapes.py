"""What a checkpoint holds, read from its safetensors headers alone, and the check that it fits the served
model: WeightSync runs it before any server loads a checkpoint, in the worker that dispatches, which
therefore never imports torch (its import held that worker's GIL ~2 s at the first update)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A checkpoint directory that does not fit the reference model (or cannot be read)."""


def tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a directory's *.safetensors files, read from the headers only."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name in shapes:
                        raise CheckpointError(f"{directory}: tensor {name} is in both {owner[name]} and {file.name}")
                    shapes[name] = tuple(reader.get_slice(name).get_shape())
                    owner[name] = file.name
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    return shapes


def validate_checkpoint(path: str | os.PathLike, reference_model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Check the checkpoint at `path` names exactly the reference model's tensors, with the same shapes.

    Returns the checkpoint's name -> shape map; raises CheckpointError listing what differs. vLLM's
    reload_weights leaves a server broken on a mismatch, so WeightSync calls this before any reload.
    With tied embeddings, `lm_head.weight` may be stored on one side and not the other.
    """
    path, reference_model_dir = Path(path), Path(reference_model_dir)
    actual = tensor_shapes(path)
    expected = tensor_shapes(reference_model_dir)
    if _tied_embeddings(reference_model_dir) and (("lm_head.weight" in actual) != ("lm_head.weight" in expected)):
        actual.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    problems = [f"missing tensor {name} {expected[name]}" for name in sorted(expected.keys() - actual.keys())]
    problems += [f"unexpected tensor {name} {actual[name]}" for name in sorted(actual.keys() - expected.keys())]
    problems += [
        f"{name}: shape {actual[name]} != reference {expected[name]}"
        for name in sorted(actual.keys() & expected.keys())
        if actual[name] != expected[name]
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(f"checkpoint {path} does not match reference model {reference_model_dir}: {shown}")
    return actual


def _tied_embeddings(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))
