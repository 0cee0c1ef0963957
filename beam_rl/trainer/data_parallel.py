"""The data-parallel trainer: N processes on torch.distributed, each reading only its own rank file.

Each rank runs the reference trainer's step (beam_rl/trainer/reference.py) on `rank_<R>.arrow` alone:
the same clipped policy loss, normalised by the trainable tokens of the whole step (summed over the ranks
first), gradients accumulated over its micro-batches, then summed over the ranks with one all-reduce of
the flattened gradients. Every rank then clips the same gradient and takes the same AdamW step, so the
replicas stay identical; rank 0 alone saves the optimizer state, publishes the weights (Hugging Face
layout, STABLE) and records the step's metrics.

Why an all-reduce of the gradients and not DistributedDataParallel's hooks: the packer gives ranks the
same tokens but not the same number of micro-batches, and a rank may have none with a trainable token;
DDP needs every rank to run the same number of backward passes. The sum is what DDP computes, once per
step instead of bucket by bucket. Gloo on CPU, NCCL on CUDA.

    beam-rl train --run-dir RUN --nproc 2
    torchrun --nproc-per-node 2 -m beam_rl.trainer.data_parallel --run-dir RUN

A rank that dies ends the others' collective with an error (within `collective_timeout_s`), and the
launcher stops the rest: the run resumes from the last published weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.nn's functions take `group=group.WORLD` as a default argument, bound when the module is
# first imported. Imported after init_process_group (transformers imports it while loading a model), they
# would hold the default group for good: destroy_process_group could not release it, and its gloo threads
# would still run while the interpreter exits, which aborts a rank now and then ('terminate called without
# an active exception'). Imported here, before any group exists, they bind None.
import torch.distributed.nn  # isort: skip

from beam_rl.config import RunConfig, TrainerSection
from beam_rl.processes import free_port, keep_triton_out
from beam_rl.rundir import RunDir
from beam_rl.trainer.policy_loss import PolicyLossStats
from beam_rl.trainer.reader import MicroBatchArrays, StepReader
from beam_rl.trainer.reference import ReferenceTrainer

COLLECTIVE_TIMEOUT_S = 300.0


class DataParallelTrainer(ReferenceTrainer):
    """One rank of the data-parallel trainer; torch.distributed must be initialised (see `main`)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | RunDir,
        model_dir: str | os.PathLike[str],
        config: TrainerSection,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the data-parallel trainer needs torch.distributed initialised (run it with "
                "torchrun or beam-rl train --nproc)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        super().__init__(run_dir, model_dir, config, seed, **kwargs)

    @property
    def publishes(self) -> bool:  # type: ignore[override]
        return self.rank == 0

    def _read_micro_batches(self, step: int, record: Any) -> list[MicroBatchArrays]:
        if record.counts.ranks != self.world_size:
            raise ValueError(
                f"{self.run.step_dir(step)}: step {step} was packed for {record.counts.ranks} ranks "
                f"(batch.trainer_ranks), the trainer runs {self.world_size} (--nproc)"
            )
        return StepReader(self.run, self.rank).read_step(step, record=record)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces on the GPU only
        dist.all_reduce(tensor)
        return tensor.tolist()

    def _sum_gradients(self) -> None:
        params = self.parameters
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            n = grad.numel()
            param.grad = flat[offset : offset + n].view_as(param).clone()
            offset += n

    def _reduce_stats(self, total: float, stats: PolicyLossStats) -> tuple[float, PolicyLossStats]:
        total, tokens, ratio_sum, clipped, kl_sum = self._sum_over_ranks(
            [total, stats.tokens, stats.ratio_sum, stats.clipped, stats.mismatch_kl_sum]
        )
        extremes = torch.tensor([stats.ratio_min, -stats.ratio_max], dtype=torch.float64, device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        return total, PolicyLossStats(
            tokens=int(tokens),
            ratio_sum=ratio_sum,
            ratio_min=float(extremes[0]),
            ratio_max=-float(extremes[1]),
            clipped=int(clipped),
            mismatch_kl_sum=kl_sum,
        )

    def _gather(self, items: list[Any]) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, items)
        return [item for rank_items in gathered for item in rank_items]


def train_rank(run_dir: str, model_dir: str, trainer: TrainerSection, max_steps: int, seed: int) -> None:
    """One rank, torch.distributed set up from the environment torchrun (or `launch`) gives it: gloo on CPU, NCCL
    on CUDA with the rank on the device of its LOCAL_RANK (`trainer.device = "cuda"` names the current device)."""
    keep_triton_out()  # a rank is a process of its own (spawned, or torchrun's)
    backend = "gloo"
    if trainer.device.startswith("cuda"):
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        torch.set_num_threads(trainer.threads)
        DataParallelTrainer(run_dir, model_dir, trainer, seed).train(max_steps)
        dist.barrier()  # every rank done with the last step's collectives before rank 0's store goes away
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
        }
    )
    train_rank(*args)


def launch(
    run_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    trainer: TrainerSection,
    max_steps: int,
    nproc: int,
    seed: int = 0,
) -> None:
    """`nproc` ranks on this machine, to `max_steps`; a rank that fails raises here, the others stopped."""
    import torch.multiprocessing as mp

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    rank_args = (str(run_dir), str(model_dir), trainer, max_steps, seed)
    # (torch.multiprocessing re-exports start_processes without marking it as exported)
    mp.start_processes(_spawned_rank, args=(nproc, free_port(), rank_args), nprocs=nproc, start_method="spawn")  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    """torchrun's entry: `torchrun --nproc-per-node N -m beam_rl.trainer.data_parallel --run-dir RUN`."""
    from beam_rl.config import config_from_dict, load_config
    from beam_rl.model.location import model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", help="default: the run directory's config.json")
    args = parser.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    config: RunConfig = (
        load_config(args.config)
        if args.config
        else config_from_dict(run_dir.read_config(), source=str(run_dir.config_path))
    )
    train_rank(str(run_dir.path), str(Path(model_dir(config))), config.trainer, config.run.max_steps, config.run.seed)


if __name__ == "__main__":
    main()
