"""The "model" and "instant" backends: requests are admitted first-come-first-served under
`max_num_seqs`, then advanced one decode step at a time, so pauses, aborts and weight reloads land
between two steps of a running request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from beam_rl.standin.admission import Aborted, Admission
from beam_rl.standin.backend import PauseGate
from beam_rl.standin.faults import FaultInjector
from beam_rl.standin.generator import (
    ChoiceResult,
    GenerationParams,
    InstantGenerator,
    ModelGenerator,
    Weights,
    WeightsError,
)
from beam_rl.standin.metrics import KV_BLOCK_SIZE, PrefixCache, kv_cache_usage


@dataclass(eq=False)
class _Live:
    """A request the backend holds, queued or running."""

    params: GenerationParams
    choices: list[ChoiceResult] = field(default_factory=list)
    state: Any = None  # the generator's state once admitted
    aborted: bool = False

    @property
    def done(self) -> bool:
        return bool(self.choices) and all(c.finish_reason is not None for c in self.choices)


class _SteppedBackend:
    """What the model and instant backends share; subclasses start a request and take its steps."""

    weights: Weights

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        gate: PauseGate,
        faults: FaultInjector,
        kv_cache_tokens: int,
    ) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.admission = Admission(max_num_seqs, gate)
        self.prefix_cache = PrefixCache()
        self.prompt_tokens = 0
        self._gate, self._faults = gate, faults
        self._kv_blocks = max(1, kv_cache_tokens // KV_BLOCK_SIZE)
        self._live: set[_Live] = set()

    # -- what the server and its metrics read -------------------------------------------------

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def max_running(self) -> int:
        return self.admission.max_running

    @property
    def busy_seconds(self) -> float:
        return self.admission.busy_seconds

    @property
    def stalled_seconds(self) -> float | None:
        return None  # measured by the simulated engine, for benchmarks

    def kv_cache_usage(self) -> float:
        return kv_cache_usage([live for live in self._live if live.state is not None], self._kv_blocks)

    def trace_since(self, since: float) -> dict[str, Any] | None:
        return None

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, params: GenerationParams, progress: bool) -> AsyncIterator[list[ChoiceResult]]:
        live = _Live(params, [ChoiceResult() for _ in range(params.n)])
        self._live.add(live)
        try:
            try:
                await self.admission.acquire(params.n)
            except Aborted:
                live.aborted = True
            else:
                try:
                    await self._begin(live, params)
                    while not live.done and not live.aborted:
                        if not self._gate.steps:
                            await self._gate.changed()  # pause "keep": frozen between two steps
                            continue
                        await self._step(live)
                        if progress and not live.done:
                            yield live.choices
                finally:
                    self.admission.release(params.n)
            if live.aborted:
                for choice in live.choices:
                    choice.finish_reason = choice.finish_reason or "abort"
            yield live.choices
        finally:
            self._live.discard(live)

    async def _begin(self, live: _Live, params: GenerationParams) -> None:
        """An admitted request's prefill: the prefix-cache lookup, the latency fault, its first state."""
        self.prefix_cache.lookup(params.prompt_ids, params.cache_salt)
        self.prompt_tokens += len(params.prompt_ids)
        if self._faults.config.latency_s:
            await asyncio.sleep(self._faults.config.latency_s)
        live.state = self._start(params)
        live.choices = live.state.choices

    async def abort_all(self) -> None:
        for live in self._live:
            live.aborted = True
        self.admission.abort_waiting()
        self._gate.notify()  # requests frozen by "keep" wake up to see they are aborted
        await self.admission.drained()

    async def running_drained(self) -> None:
        await self.admission.drained(queued=False)

    def _start(self, params: GenerationParams) -> Any:
        raise NotImplementedError

    async def _step(self, live: _Live) -> None:
        raise NotImplementedError

    async def quiesce(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class ModelBackend(_SteppedBackend):
    """A tiny real causal LM (generator.ModelGenerator) on one model thread: torch work never blocks
    the event loop, and weight reloads are serialised with decode steps, so a reload lands between
    two steps of every running request. The decode steps of all requests interleave on that thread,
    like a batch scheduler. `step_delay_s` sleeps on the model thread: a slower GPU."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        max_num_seqs: int,
        gate: PauseGate,
        faults: FaultInjector,
        kv_cache_tokens: int,
        torch_threads: int | None = 1,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        self.generator = ModelGenerator(model_dir, device, dtype)
        super().__init__(
            self.generator.vocab_size, self.generator.max_model_len, max_num_seqs, gate, faults, kv_cache_tokens
        )
        if torch_threads is not None:
            # Process-wide, unavoidably: a tiny model's matmuls gain nothing from intra-op threads
            # and run ~10x slower when those threads contend for busy cores.
            torch.set_num_threads(torch_threads)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    @property
    def weights(self) -> Weights:  # type: ignore[override]
        return self.generator.weights

    @property
    def generation_tokens(self) -> int:
        return self.generator.generation_tokens

    def _start(self, params: GenerationParams) -> Any:
        return self.generator.start(params)

    async def _step(self, live: _Live) -> None:
        await self._on_model_thread(self._step_sync, live.state, self._faults.config.step_delay_s)

    def _step_sync(self, state: Any, delay_s: float) -> None:
        if delay_s:
            time.sleep(delay_s)
        self.generator.step(state)

    async def quiesce(self) -> None:
        await self._on_model_thread(lambda: None)  # queued behind any step already submitted

    async def load_weights(self, weights_path: str) -> None:
        # Read and check off the model thread, so decoding goes on while a checkpoint loads.
        tensors = await asyncio.to_thread(self._check_weights, weights_path)
        await self._on_model_thread(self.generator.load_weights, tensors)

    async def label_weights(self, label: str) -> None:
        await self._on_model_thread(self.generator.label, label)

    async def load_adapter(self, name: str, path: str) -> None:
        """Between two steps, as a reload: requests naming other adapters (or none) are untouched."""
        await self._on_model_thread(self.generator.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._on_model_thread(self.generator.unload_adapter, name)

    def _check_weights(self, weights_path: str) -> dict[str, torch.Tensor]:
        try:
            return self.generator.check_weights(weights_path)
        except WeightsError:
            raise
        except Exception as exc:  # an unreadable file is the checkpoint's fault, not the server's
            raise WeightsError(f"cannot read checkpoint {weights_path}: {type(exc).__name__}: {exc}") from exc

    async def _on_model_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._thread.shutdown, True, cancel_futures=True)


@dataclass
class _InstantState:
    params: GenerationParams
    plan: list[ChoiceResult]  # every token, drawn at once; revealed step by step
    choices: list[ChoiceResult]


class InstantBackend(_SteppedBackend):
    """No model: the pseudo-random tokens of generator.InstantGenerator, revealed all in one step,
    or one token per step when `step_delay_s` is set (so a pause or a reload can land mid-request)."""

    def __init__(
        self,
        vocab_size: int,
        special_ids: set[int],
        max_num_seqs: int,
        gate: PauseGate,
        faults: FaultInjector,
        kv_cache_tokens: int,
    ) -> None:
        self.generator = InstantGenerator(vocab_size, special_ids)
        super().__init__(vocab_size, self.generator.max_model_len, max_num_seqs, gate, faults, kv_cache_tokens)
        self.weights = Weights()
        self.generation_tokens = 0

    def _start(self, params: GenerationParams) -> _InstantState:
        plan = self.generator.start(params).choices
        return _InstantState(params, plan, [ChoiceResult() for _ in plan])

    async def _step(self, live: _Live) -> None:
        delay_s = self._faults.config.step_delay_s
        if delay_s:
            await asyncio.sleep(delay_s)
            if not self._gate.steps or live.aborted:
                return  # paused or aborted during the step: it samples nothing
        state: _InstantState = live.state
        for planned, choice in zip(state.plan, state.choices):
            start = len(choice.token_ids)
            end = start + 1 if delay_s else len(planned.token_ids)
            choice.token_ids += planned.token_ids[start:end]
            choice.logprobs += planned.logprobs[start:end]
            choice.top_logprobs += planned.top_logprobs[start:end]
            choice.sampled_by += [self.weights] * (end - start)
            self.generation_tokens += end - start
            if end >= len(planned.token_ids):
                choice.finish_reason = planned.finish_reason

    async def quiesce(self) -> None:
        return None  # steps run on the event loop: none is in flight while the caller runs

    async def load_weights(self, weights_path: str) -> None:
        # No model to check shapes against; still refuse a path with no weights.
        if not any(pathlib.Path(weights_path).glob("*.safetensors")):
            raise WeightsError(f"no *.safetensors files in {weights_path}")
        self.weights = self.weights.loaded()

    async def label_weights(self, label: str) -> None:
        self.weights = self.weights.labelled(label)  # steps run on this loop: between two of them
