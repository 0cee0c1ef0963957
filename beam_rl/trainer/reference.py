"""The reference trainer: reads each committed step from the run directory, takes one AdamW step on the
clipped policy loss, and publishes the new policy's weights for WeightSync (PyTorch, CPU)."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from beam_rl.config import LoraSection, TrainerSection
from beam_rl.model.tiny import load_tiny_model
from beam_rl.rundir import RunDir
from beam_rl.rundir.checkpoint_shapes import validate_checkpoint
from beam_rl.trainer.checkpoint import (
    load_optimizer_state,
    prune_optimizer_states,
    publish_weights,
    quiet_progress_bars,
    save_optimizer_state,
)
from beam_rl.trainer.policy_loss import (
    PolicyLossStats,
    check_packed_attention,
    clipped_policy_loss,
    sampled_token_logprobs,
)
from beam_rl.trainer.reader import MicroBatchArrays, StepReader

logger = logging.getLogger(__name__)

# How often a trainer waiting for data looks at its stop event.
_STOP_POLL_S = 0.25

StepMetrics = dict[str, Any]


class ReferenceTrainer:
    """Trains policy s-1 into policy s on step s's batch, for s = start_step .. max_steps.

    Starts from the latest STABLE weights of the run directory (and the optimizer state saved with
    them) if any, else from `model_dir`. Each step reads every rank's micro-batches (one process
    stands in for all data-parallel ranks: accumulating their gradients is what an all-reduce would
    sum), accumulates the gradient of `clipped_policy_loss` over them, clips the global gradient norm,
    takes one AdamW step, and publishes weights/step_<s>/ + STABLE. Per-step metrics are both
    returned and appended to metrics.jsonl as {"trainer": {...}}.

    A step whose samples hold no trainable token still publishes (unchanged) weights, so the policy
    version advances and the pipeline is never left waiting for it.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | RunDir,
        model_dir: str | os.PathLike[str],
        config: TrainerSection,
        seed: int = 0,
        *,
        stop_event: threading.Event | None = None,
        progress: Callable[[StepMetrics], None] | None = None,
    ) -> None:
        self.run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.model_dir = Path(model_dir)
        self.config = config
        self.seed = seed
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.progress = progress
        latest = self.run.latest_stable_weights()
        if latest is not None:  # a run dir of another model (or of another kind of checkpoint) must not be resumed
            validate_checkpoint(latest[1], self.model_dir, lora=config.lora is not None)
        self.start_step = 1 if latest is None else latest[0] + 1
        self.step = self.start_step  # the next step to train
        self.device = torch.device(config.device)
        if config.lora is None:
            model = _load_policy(self.model_dir if latest is None else latest[1])
        else:
            model = with_lora(
                _load_policy(self.model_dir), config.lora, seed, adapter_dir=None if latest is None else latest[1]
            )
        # Checked on the device in float32: the masking is what is checked, and bfloat16's rounding would hide it.
        check_packed_attention(model.to(self.device))
        self.model = model.to(dtype=getattr(torch, config.dtype)).train()
        # LoRA freezes the base: only what trains is optimised, clipped and (data-parallel) summed.
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.lr, weight_decay=config.weight_decay)
        self.resumed_optimizer = latest is not None and load_optimizer_state(self.run, latest[0], self.optimizer)
        if latest is not None and not self.resumed_optimizer:
            logger.warning("%s: no optimizer state for step %d; AdamW restarts from zero moments", self.run, latest[0])

    def stop(self) -> None:
        """Ask `train` to return: at once while waiting for data, after the current step otherwise."""
        self.stop_event.set()

    def train(self, max_steps: int, timeout_s: float | None = None) -> list[StepMetrics]:
        """Train steps self.step .. max_steps (inclusive); returns their metrics.

        `timeout_s` bounds the wait for each step's data (None: wait as long as it takes); running out
        raises TimeoutError naming the step. Returns early, with the steps done so far, on `stop()`.
        """
        done: list[StepMetrics] = []
        while self.step <= max_steps and not self.stop_event.is_set():
            started = time.monotonic()
            if not self._wait_for_step(self.step, timeout_s):
                break
            done.append(self.train_step(self.step, wait_s=time.monotonic() - started))
        return done

    def train_step(self, step: int, wait_s: float = 0.0) -> StepMetrics:
        """Train on committed step `step`, publish its weights, record and return its metrics."""
        t0 = time.monotonic()
        # Every rank's file is verified against the commit record (StepCorruptError names a damaged one)
        # before any gradient is taken: a damaged step trains nothing and publishes nothing.
        record = self.run.read_commit(step)
        micro_batches = self._read_micro_batches(step, record)
        for mb in micro_batches:
            _check_positions(mb, self.run, step)
        t1 = time.monotonic()
        # Seeded per step: a resumed run replays any randomness (dropout) of a step exactly.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + step)
            loss, stats, grad_norm = self._optimize(step, micro_batches)
        t2 = time.monotonic()
        if self.publishes:
            # Optimizer state first: STABLE weights must never exist without the state to resume them.
            save_optimizer_state(self.run, step, self.optimizer)
            publish_weights(self.run, step, self.model, source_dir=self.model_dir)
            prune_optimizer_states(self.run, keep_step=step)
        t3 = time.monotonic()
        self.step = step + 1

        # Per sample: the version its rollout started on (the per-token `policy_versions` are not used here).
        parts = self._gather(
            [(mb["sample_policy_versions"], mb["rewards"], len(mb["input_ids"])) for mb in micro_batches]
        )
        versions = np.concatenate([v for v, _, _ in parts]) if parts else np.zeros(0)
        rewards = np.concatenate([r for _, r, _ in parts]) if parts else np.zeros(0)
        staleness = (step - 1) - versions  # docs/design.md, "Staleness": step s trains policy s-1
        metrics: StepMetrics = {
            "step": step,
            "policy_version": step,
            "loss": loss,
            **stats.summary(),
            "grad_norm": grad_norm,
            "lr": self.config.lr,
            "trainable_tokens": stats.tokens,
            "tokens": int(sum(n for _, _, n in parts)),
            "samples": len(versions),
            "micro_batches": len(parts),
            "ranks": record.counts.ranks,
            "processes": self.world_size,  # trainer processes that took the step together
            "reward_mean": float(rewards.mean()) if len(rewards) else None,
            "staleness_mean": float(staleness.mean()) if len(staleness) else None,
            "staleness_max": int(staleness.max()) if len(staleness) else None,
            "wait_s": round(wait_s, 6),
            "read_s": round(t1 - t0, 6),
            "compute_s": round(t2 - t1, 6),
            "publish_s": round(t3 - t2, 6),
        }
        if self.publishes:
            self.run.append_metrics({"trainer": metrics})
        logger.info(
            "trainer step %d: loss %.4f, ratio %.4f, clip %.3f, %d tokens",
            step,
            loss,
            metrics["ratio_mean"],
            metrics["clip_fraction"],
            stats.tokens,
        )
        if self.progress is not None:
            self.progress(metrics)
        return metrics

    # -- what a data-parallel rank does differently (beam_rl/trainer/data_parallel.py) ----------------

    publishes = True  # this process saves the optimizer state, publishes the weights and records metrics
    world_size = 1

    def _read_micro_batches(self, step: int, record: Any) -> list[MicroBatchArrays]:
        """The step's micro-batches this process trains on: every rank's (it stands in for all of them)."""
        return [
            mb
            for rank in range(record.counts.ranks)
            for mb in StepReader(self.run, rank).read_step(step, record=record)
        ]

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        return values

    def _sum_gradients(self) -> None:
        pass

    def _reduce_stats(self, total: float, stats: PolicyLossStats) -> tuple[float, PolicyLossStats]:
        return total, stats

    def _gather(self, items: list[Any]) -> list[Any]:
        return items

    def _optimize(self, step: int, micro_batches: list[MicroBatchArrays]) -> tuple[float, PolicyLossStats, float]:
        """Accumulate the loss gradient over the micro-batches (all ranks' gradients summed), then one
        clipped AdamW step."""
        cfg = self.config
        trainable = [_trainable_mask(mb) for mb in micro_batches]
        num_tokens = int(self._sum_over_ranks([float(sum(int(m.sum()) for m in trainable))])[0])
        self.optimizer.zero_grad(set_to_none=True)
        total, stats = 0.0, PolicyLossStats()
        if num_tokens == 0:
            return total, stats, 0.0
        for mb, mask in zip(micro_batches, trainable):
            if not mask.any():
                continue
            logp_new = sampled_token_logprobs(
                self.model,
                self.as_tensor(mb["input_ids"]),
                self.as_tensor(mb["position_ids"]),
                self.as_tensor(mb["temperatures"]),
            )
            loss, mb_stats = clipped_policy_loss(
                logp_new,
                self.as_tensor(mb["logprobs"]),
                self.as_tensor(mb["advantages"]),
                self.as_tensor(mask),
                clip_eps_low=cfg.clip_eps_low,
                clip_eps_high=cfg.clip_eps_high,
                num_tokens=num_tokens,
            )
            loss.backward()
            total += float(loss.detach())
            stats = stats + mb_stats
        self._sum_gradients()
        total, stats = self._reduce_stats(total, stats)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, cfg.max_grad_norm))
        if not (np.isfinite(grad_norm) and np.isfinite(total)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"{self.run.step_dir(step)}: loss {total} / gradient norm {grad_norm} is not finite; "
                "the policy is left at the previous step and nothing is published"
            )
        self.optimizer.step()
        return total, stats, grad_norm

    def as_tensor(self, array: np.ndarray) -> torch.Tensor:
        # A copy on the trainer's device: the reader's arrays are read-only views of the memory-mapped file.
        return torch.tensor(np.asarray(array), device=self.device)

    def _wait_for_step(self, step: int, timeout_s: float | None) -> bool:
        """True once `step` is committed; False if stopped first, or if the run's input ended with an earlier
        step (the run is over before max_steps); TimeoutError after `timeout_s`."""
        reader = StepReader(self.run)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.stop_event.is_set():
            last = self.run.input_last_step()
            if last is not None and step > last and not self.run.is_committed(step):
                logger.info("the run's input ended with step %d: nothing more to train", last)
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{self.run.path}: step {step} not committed within {timeout_s} s")
            try:
                # Short slices keep a stop prompt; the reader's own backoff paces the polling inside each.
                slice_s = _STOP_POLL_S if remaining is None else min(_STOP_POLL_S, remaining)
                reader.wait_for_step(step, timeout_s=slice_s)
                return True
            except TimeoutError:
                continue
        return False


def run_trainer(
    run_dir: str | os.PathLike[str] | RunDir,
    model_dir: str | os.PathLike[str],
    trainer_cfg: TrainerSection,
    max_steps: int,
    seed: int = 0,
    stop_event: threading.Event | None = None,
    *,
    timeout_s: float | None = None,
    progress: Callable[[StepMetrics], None] | None = None,
) -> list[StepMetrics]:
    """The CLI's entry point: train (or resume) up to step `max_steps`; returns the per-step metrics of this call."""
    trainer = ReferenceTrainer(run_dir, model_dir, trainer_cfg, seed, stop_event=stop_event, progress=progress)
    return trainer.train(max_steps, timeout_s=timeout_s)


def _load_policy(path: str | os.PathLike[str]) -> torch.nn.Module:
    with quiet_progress_bars():
        return load_tiny_model(path)  # any local Hugging Face causal LM, float32 on CPU


def with_lora(
    model: torch.nn.Module, lora: LoraSection, seed: int, adapter_dir: str | os.PathLike[str] | None = None
) -> torch.nn.Module:
    """`model` frozen under a trainable LoRA adapter (peft): the published one at `adapter_dir`, or a new one
    (B = 0, so it starts as the base model; A drawn from `seed`)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; scales by a float target_modules=list(lora.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers a question it deprecated (is_gradient_checkpointing): the user can do nothing.
        warnings.simplefilter("ignore", FutureWarning)
        if adapter_dir is not None:
            return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def _trainable_mask(mb: MicroBatchArrays) -> np.ndarray:
    # A sample's first token has no logprob (nothing before it in its sample): it cannot be trained on.
    return np.asarray(mb["loss_mask"], dtype=bool) & (np.asarray(mb["position_ids"]) > 0)


def _check_positions(mb: MicroBatchArrays, run: RunDir, step: int) -> None:
    # Attention is kept within samples by the position ids alone; if they disagree with seq_len the
    # samples would silently bleed into each other.
    cu_seqlens = np.asarray(mb["cu_seqlens"])
    expected = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1], mb["seq_lens"])
    if not np.array_equal(mb["position_ids"], expected):
        raise ValueError(
            f"{run.step_dir(step)}: micro-batch {mb['micro_batch']} has position_ids that do not restart at 0 "
            "on every sample (by seq_len)"
        )
