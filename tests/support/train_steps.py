"""Committed steps for the trainer's tests: samples of the tiny model whose inference logprobs are its own, written
as a step of a run directory, and what the tests read back from a model."""

from __future__ import annotations

import numpy as np
import torch

from beam_rl.packing.packer import pack_for_ranks
from beam_rl.rundir import RunDir
from beam_rl.types import Sample, TrainBatch

TEMPERATURE = 0.8


def own_logprobs(model, ids: np.ndarray) -> np.ndarray:
    """log pi(ids[t] | ids[:t]) at TEMPERATURE from one plain forward of the sample alone; 0 at t = 0."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0]
    logp = torch.log_softmax(logits[:-1].float() / TEMPERATURE, dim=-1)
    picked = logp.gather(1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0]
    return np.concatenate([[0.0], picked.numpy()]).astype(np.float32)


def make_samples(model, seed: int, advantages: list[float], version: int = 0) -> list[Sample]:
    """One sample per advantage: a random prompt then a completion whose inference logprobs are the model's own."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, advantage in enumerate(advantages):
        prompt, completion = int(rng.integers(3, 7)), int(rng.integers(3, 8))
        ids = rng.integers(3, 500, size=prompt + completion).astype(np.int32)
        mask = np.arange(len(ids)) >= prompt
        samples.append(Sample(
            input_ids=ids,
            loss_mask=mask,
            logprobs=np.where(mask, own_logprobs(model, ids), 0.0).astype(np.float32),
            advantages=np.where(mask, advantage, 0.0).astype(np.float32),
            temperatures=np.full(len(ids), TEMPERATURE, np.float32),
            rollout_id=f"g{seed}-{i // 2}/{i % 2}",
            group_id=f"g{seed}-{i // 2}",
            policy_version=version,
            reward=float(advantage > 0),
        ))
    return samples


def write_step(run: RunDir, step: int, samples: list[Sample], ranks: int = 1, seq_len: int = 24) -> None:
    micro_batches = pack_for_ranks(samples, seq_len=seq_len, ranks=ranks)
    group_ids = sorted({s.group_id for s in samples})
    run.write_step(TrainBatch(step=step, micro_batches=micro_batches, group_ids=group_ids, window={}))


def completion_logprob_sum(model, samples: list[Sample]) -> float:
    was_training = model.training
    model.eval()
    try:
        return float(sum(own_logprobs(model, s.input_ids)[s.loss_mask].sum() for s in samples))
    finally:
        model.train(was_training)


def weights_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
