"""What a checkpoint holds, read from its safetensors headers alone, and the check that it fits the served
model (whole weights, or a LoRA adapter of it): WeightSync runs it before any server loads a checkpoint, in
the worker that dispatches, which therefore never imports torch (its import held that worker's GIL ~2 s at
the first update)."""

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


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside a LoRA adapter
_PEFT_PREFIX = "base_model.model."
_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(path: str | os.PathLike) -> bool:
    """A published LoRA adapter (peft's layout), as opposed to whole weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def validate_checkpoint(
    path: str | os.PathLike, reference_model_dir: str | os.PathLike, lora: bool = False
) -> dict[str, tuple[int, ...]]:
    """Check the checkpoint at `path` fits the reference model: whole weights name exactly its tensors, with
    the same shapes; with `lora`, an adapter whose every A/B pair fits a Linear of the model.

    Returns the checkpoint's name -> shape map; raises CheckpointError listing what differs. vLLM's
    reload_weights leaves a server broken on a mismatch, so WeightSync calls this before any reload.
    With tied embeddings, `lm_head.weight` may be stored on one side and not the other.
    """
    path, reference_model_dir = Path(path), Path(reference_model_dir)
    if lora != is_adapter(path):
        raise CheckpointError(
            f"{path}: {'whole weights' if lora else 'a LoRA adapter'}, but the run "
            f"{'trains a LoRA adapter (trainer.lora)' if lora else 'trains whole weights'}"
        )
    actual = tensor_shapes(path)
    expected = tensor_shapes(reference_model_dir)
    if lora:
        return _validate_adapter(path, actual, expected, reference_model_dir)
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
        raise CheckpointError(
            f"checkpoint {path} does not match reference model {reference_model_dir}: {_listed(problems)}"
        )
    return actual


def _validate_adapter(
    path: Path, actual: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]], reference_model_dir: Path
) -> dict[str, tuple[int, ...]]:
    """lora_A is (rank, in) and lora_B (out, rank) of a base weight (out, in) named by the same module path."""
    problems = []
    modules = {
        name[len(_PEFT_PREFIX) : -len(_LORA_A)]
        for name in actual
        if name.startswith(_PEFT_PREFIX) and name.endswith(_LORA_A)
    }
    if not modules:
        problems.append("no lora_A tensors")
    for module in sorted(modules):
        a, b = actual[f"{_PEFT_PREFIX}{module}{_LORA_A}"], actual.get(f"{_PEFT_PREFIX}{module}{_LORA_B}")
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            problems.append(f"{module}: no Linear of that name in the model")
        elif b is None:
            problems.append(f"{module}: lora_A without lora_B")
        elif not (len(a) == len(b) == 2 and a[1] == weight[1] and b[0] == weight[0] and a[0] == b[1]):
            problems.append(f"{module}: lora_A {a} and lora_B {b} do not fit its weight {weight}")
    others = sorted(n for n in actual if not n.endswith((_LORA_A, _LORA_B)))
    problems += [f"unexpected tensor {name}" for name in others]
    if problems:
        raise CheckpointError(f"adapter {path} does not fit reference model {reference_model_dir}: {_listed(problems)}")
    return actual


def _listed(problems: list[str], shown: int = 6) -> str:
    """The first `shown` problems, and how many more."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")


def matrix_module_names(model_dir: str | os.PathLike) -> set[str]:
    """The last path part of every 2-D weight of a model ("q_proj"): what LoRA's target_modules may name."""
    return {
        name[: -len(".weight")].rsplit(".", 1)[-1]
        for name, shape in tensor_shapes(model_dir).items()
        if name.endswith(".weight") and len(shape) == 2
    }


def _tied_embeddings(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))
