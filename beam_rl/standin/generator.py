"""Token generation for the embedded server: a real causal LM stepped one token at a time, or an
instant fake, plus validated in-place weight reloads.

Everything here is synchronous; the "model" backend (stepped.py) runs it on one model thread and
interleaves the decode steps of all running requests, so a long request never starves the others.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import secrets
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from beam_rl.model.tiny import load_tiny_model

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


class WeightsError(ValueError):
    """A checkpoint that does not fit the served model; the model is left untouched."""


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: tuple[int, ...]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    top_logprobs: int = 0  # how many alternatives per position to report (0 = none)
    cache_salt: str | None = None  # prefix-cache salt: a prompt under another salt never hits
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)


@dataclass(frozen=True)
class Weights:
    """The weights a step samples with: the loads before it (the server's own count) and the label vLLM's
    `/update_weight_version` last set ("default" until then). Either changes only between two steps, so
    a label set while nothing samples names exactly the tokens sampled after it, whatever the order of
    the label and the load, as in vLLM's engine."""

    loads: int = 0
    label: str = "default"

    def loaded(self) -> Weights:
        return dataclasses.replace(self, loads=self.loads + 1)

    def labelled(self, label: str) -> Weights:
        return dataclasses.replace(self, label=label)


@dataclass
class ChoiceResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    sampled_by: list[Weights] = field(default_factory=list)  # the weights of each token's step
    finish_reason: str | None = None

    @property
    def weight_versions(self) -> list[int]:
        """The loads before each token: which weights sampled it, by the server's count."""
        return [w.loads for w in self.sampled_by]


def _finish_reason(token: int, length: int, params: GenerationParams, eos: frozenset[int]) -> str | None:
    # A stop/EOS token on the last allowed position still counts as "stop", as in vLLM.
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
        return "stop"
    if length >= params.max_tokens:
        return "length"
    return None


@dataclass
class _ModelState:
    params: GenerationParams
    rng: torch.Generator
    choices: list[ChoiceResult]
    cache: Any = None
    last_tokens: torch.Tensor | None = None  # [n, 1]

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class ModelGenerator:
    """Samples from a Hugging Face causal LM with a KV cache, one decode step per call.

    Reported logprobs are log-softmax of the temperature-scaled logits at the sampled token, i.e.
    the distribution actually sampled from (vLLM's "processed" logprobs); greedy requests report
    the unscaled log-softmax. The n choices of one request share a single prefill.
    """

    def __init__(self, model_dir: str | pathlib.Path, device: str = "cpu", dtype: str = "float32") -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.device = torch.device(device)
        self.model = load_tiny_model(self.model_dir).to(device=self.device, dtype=getattr(torch, dtype))  # type: ignore[call-arg]
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(config.max_position_embeddings)
        eos = config.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids = set()
        for value in (eos, gen_eos):
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        self.eos_token_ids = frozenset(ids)
        self._shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        # transformers 5.x renamed the forward argument `past_key_values` to `cache`.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self.weights = Weights()  # changed by load_weights and label, on the same thread as the steps
        self.generation_tokens = 0
        self.adapters: set[str] = set()  # LoRA adapters injected into self.model's layers (peft)

    def load_adapter(self, name: str, path: str | pathlib.Path) -> None:
        """Add a LoRA adapter (peft layout) that requests may name; the base model and other adapters stay."""
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        directory = pathlib.Path(path)
        config = LoraConfig.from_pretrained(str(directory))
        with warnings.catch_warnings():  # peft warns that a model holds several adapters: this one serves many
            warnings.simplefilter("ignore", UserWarning)
            inject_adapter_in_model(config, self.model, adapter_name=name)
        state = load_file(str(directory / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.model, state, adapter_name=name)
        self.adapters.add(name)

    def unload_adapter(self, name: str) -> None:
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                module.delete_adapter(name)
        self.adapters.discard(name)

    def _activate(self, adapter: str | None) -> None:
        """The LoRA layers' active adapter for the next forward pass: `adapter`, or none (the base model)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if not self.adapters:
            return
        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.enable_adapters(adapter is not None)
                if adapter is not None:
                    module.set_adapter(adapter)

    def start(self, params: GenerationParams) -> _ModelState:
        rng = torch.Generator(device=self.device)  # multinomial draws with a generator on the logits' device
        # Unseeded requests draw fresh OS entropy (never the process-wide torch RNG, which callers own).
        rng.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return _ModelState(params, rng, [ChoiceResult() for _ in range(params.n)])

    @torch.inference_mode()
    def step(self, state: _ModelState) -> None:
        params = state.params
        self._activate(params.adapter)
        if state.cache is None:
            # One prefill for the prompt, its KV cache then fanned out to the n choices.
            prompt = torch.tensor([params.prompt_ids], dtype=torch.long, device=self.device)
            out = self.model(input_ids=prompt, use_cache=True)
            state.cache = out.get("cache", None) or out.get("past_key_values")
            if params.n > 1:
                state.cache.batch_repeat_interleave(params.n)
            logits = out.logits[:, -1, :].expand(params.n, -1)
        else:
            # The cache object is updated in place.
            out = self.model(input_ids=state.last_tokens, use_cache=True, **{self._cache_arg: state.cache})
            logits = out.logits[:, -1, :]
        logits = logits.float()
        if params.temperature < GREEDY_EPS:
            logprobs = torch.log_softmax(logits, dim=-1)
            tokens = torch.argmax(logits, dim=-1)
        else:
            logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
            tokens = torch.multinomial(logprobs.exp(), 1, generator=state.rng).squeeze(1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top = torch.topk(logprobs, params.top_logprobs, dim=-1) if params.top_logprobs else None
        weights = self.weights
        for i, choice in enumerate(state.choices):
            if choice.finish_reason is not None:
                continue  # finished sequences still ride along in the batch; their tokens are dropped
            token = int(tokens[i])
            choice.token_ids.append(token)
            choice.logprobs.append(float(chosen[i]))
            choice.sampled_by.append(weights)
            self.generation_tokens += 1
            if top is not None:
                alternatives = dict(zip(top.indices[i].tolist(), top.values[i].tolist()))
                alternatives[token] = float(chosen[i])
                choice.top_logprobs.append(alternatives)
            choice.finish_reason = _finish_reason(token, len(choice.token_ids), params, self.eos_token_ids)
        state.last_tokens = tokens[:, None]

    def check_weights(self, weights_path: str | pathlib.Path) -> dict[str, torch.Tensor]:
        """Read a safetensors checkpoint and check it names exactly the model's tensors, shapes included.

        Reads nothing of the live model but its (fixed) shapes, so it may run beside decode steps.
        """
        directory = pathlib.Path(weights_path)
        files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
        if not files:
            raise WeightsError(f"no *.safetensors files in {directory}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    tensors[name] = reader.get_tensor(name)
        expected = dict(self._shapes)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        if tied and "lm_head.weight" in expected and "lm_head.weight" not in tensors:
            expected.pop("lm_head.weight")  # tied checkpoints store only the embedding
        problems = [f"unexpected tensor {n}" for n in sorted(set(tensors) - set(expected))]
        problems += [f"missing tensor {n}" for n in sorted(set(expected) - set(tensors))]
        problems += [
            f"{n}: shape {tuple(t.shape)} != expected {expected[n]}"
            for n, t in sorted(tensors.items())
            if n in expected and tuple(t.shape) != expected[n]
        ]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightsError(f"checkpoint {directory} does not fit the served model: {shown}")
        return tensors

    @torch.inference_mode()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the live model (in place: KV caches of running requests stay
        valid) and bump the weights version."""
        if self.adapters:
            raise WeightsError(f"whole weights cannot load while LoRA adapters {sorted(self.adapters)} are loaded")
        params = self.model.state_dict()
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(params[name].dtype))
        self.weights = self.weights.loaded()

    def label(self, label: str) -> None:
        self.weights = self.weights.labelled(label)


@dataclass
class _InstantState:
    params: GenerationParams
    choices: list[ChoiceResult]

    @property
    def done(self) -> bool:
        return True


class InstantGenerator:
    """No model: exactly `max_tokens` pseudo-random non-special ids with logprob -1.0, at once.

    For measuring orchestration overhead. Ids depend only on (seed or prompt, choice index).
    """

    logprob = -1.0

    def __init__(self, vocab_size: int, special_ids: set[int] | frozenset[int], max_model_len: int = 1024) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids: frozenset[int] = frozenset()
        # Never emit special ids: an accidental EOS would make "instant" lengths unpredictable.
        self._allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))

    def start(self, params: GenerationParams) -> _InstantState:
        prompt_key = zlib.crc32(np.asarray(params.prompt_ids, np.int64).tobytes())
        base = params.seed if params.seed is not None else prompt_key
        choices = []
        for i in range(params.n):
            ids = np.random.default_rng([base, i]).choice(self._allowed, size=params.max_tokens).tolist()
            choices.append(
                ChoiceResult(
                    token_ids=ids,
                    logprobs=[self.logprob] * len(ids),
                    top_logprobs=[{t: self.logprob} for t in ids] if params.top_logprobs else [],
                    finish_reason="length",
                )
            )
        return _InstantState(params, choices)

    def step(self, state: _InstantState) -> None:
        return None
