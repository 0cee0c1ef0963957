"""TRL's own rollout loop (`trl.experimental.async_grpo`'s AsyncRolloutWorker) driven as a peer of beam-rl.

Runs inside TRL's virtualenv (bench/peers/trl_peer.py builds it), which has TRL and its dependencies but not
beam-rl: beside them it imports only `bench.peers.job` (standard library only) for the contract.
It does with the worker what TRL's AsyncGRPOTrainer does on rank 0, without the training:
- builds the worker over the prompts as a `datasets.Dataset` and starts it: TRL spawns its asyncio child, which
  renders each prompt with the tokenizer (here: the prompts file's own token ids, `PromptIdsTokenizer`), posts
  them to `/v1/completions` with `return_token_ids`, and scores each finished group;
- takes the scored samples off the worker's `rollout_buffer` as the trainer does, and appends one line per
  rollout to the out file (the peers contract, flushed per line: the harness reads it live);
- stops the worker after `--groups` groups.
One name is patched: TRL's constructor refuses to start unless vLLM is importable, though neither process
imports it (`_allow_without_vllm`).
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.peers.job
from transformers import PreTrainedTokenizerFast

from bench.peers.job import SLOTS_PER_SERVER, PeerJob, append_rollout, load_job, read_prompts

HEALTH_STALE_S = 300.0  # TRL's own allowance for the child's start (child_ready_timeout)


class PromptIdsTokenizer(PreTrainedTokenizerFast):
    """The tiny tokenizer, rendering a prompt that carries its token ids as those ids: TRL's worker re-renders
    every conversation through `apply_chat_template`, and the prompts file's ids (random tokens in the harness's
    workloads) do not survive a decode and encode, so the worker would post other, longer prompts than every
    other system does. Module-level so the spawned child can unpickle it."""

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if len(conversation) == 1 and conversation[0].get("prompt_ids") is not None:
            return list(conversation[0]["prompt_ids"])
        return super().apply_chat_template(conversation, *args, **kwargs)


def no_reward(completions: list[Any], **_: Any) -> list[float]:
    """The worker requires a reward source; the harness measures generation. Module-level so the spawned child
    can unpickle it."""
    return [0.0] * len(completions)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--job", required=True, type=Path, help="the PeerJob, as bench.peers.job.save_job wrote it")
    parser.add_argument("--tokenizer", required=True, help="the served model's tokenizer, a local directory")
    return parser.parse_args(argv)


def worker_settings(job: PeerJob) -> dict[str, Any]:
    """The worker's arguments that the job decides. TRL's worker takes one server (its config's
    vllm_server_base_url): the fleet's first. In flight, as every peer keeps: the fleet's slots."""
    return {
        "vllm_server_url": job.urls[0],
        "model_name": job.model,
        "num_generations": job.group_size,
        "max_tokens": job.max_tokens,
        "max_inflight_tasks": len(job.urls) * SLOTS_PER_SERVER,
    }


def rollout_line(
    group_id: int, completion_mask: Any, completion_ids: Any, stop_ids: set[int], group_ids: list[str]
) -> dict[str, Any]:
    """The contract's fields for one of TRL's samples. TRL numbers groups as it draws prompts, cycling through
    the dataset, so group k is prompt k mod len. TRL keeps no finish_reason: a completion that does not end on
    EOS or pad was cut off by max_tokens (its `completions/clipped_ratio`), and that is the reason given."""
    completion = [int(t) for t, m in zip(completion_ids, completion_mask, strict=True) if m]
    return {
        "group_id": group_ids[group_id % len(group_ids)],
        "completion_tokens": len(completion),
        "finish_reason": "stop" if completion and completion[-1] in stop_ids else "length",
    }


def _allow_without_vllm() -> None:
    # The parent only checks that the name imports; the spawned child talks HTTP with aiohttp and never imports
    # vllm, so the check is all a machine without vLLM trips on.
    from trl.experimental.async_grpo import async_rollout_worker  # type: ignore[import-not-found]

    async_rollout_worker.is_vllm_available = lambda *args, **kwargs: True


def _tokenizer(path: str) -> Any:
    from trl.chat_template_utils import qwen3_template  # type: ignore[import-not-found]

    tokenizer = PromptIdsTokenizer.from_pretrained(path)
    # The worker parses every answer for tool calls and refuses a tokenizer whose response template it does not
    # know; the tiny model speaks Qwen's markup, so TRL's own Qwen3 parser is the one it is given.
    tokenizer.response_template = qwen3_template
    return tokenizer


def _worker(job: PeerJob, prompts: list[dict[str, Any]], tokenizer: Any) -> Any:
    from datasets import Dataset  # type: ignore[import-not-found]
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker  # type: ignore[import-not-found]

    messages = [[{"role": "user", "content": row["prompt"], "prompt_ids": row["prompt_ids"]}] for row in prompts]
    return AsyncRolloutWorker(
        dataset=Dataset.from_list([{"prompt": conversation} for conversation in messages]),
        reward_funcs=[no_reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        **worker_settings(job),
    )


def main() -> None:
    args = parse_args()
    job = load_job(args.job)
    # The trainer's Accelerator sets up accelerate's state, which the worker's logging needs.
    from accelerate.state import PartialState  # type: ignore[import-untyped]

    PartialState()
    _allow_without_vllm()
    prompts = read_prompts(job.prompts_path)
    tokenizer = _tokenizer(args.tokenizer)
    worker = _worker(job, prompts, tokenizer)
    group_ids = [str(row["group_id"]) for row in prompts]
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    delivered: dict[int, int] = {}  # TRL's group number -> its rollouts delivered
    finished = 0
    worker.start()
    try:
        with open(job.out_path, "a") as out:
            while finished < job.groups:
                try:
                    sample = worker.rollout_buffer.get(timeout=1.0)
                except queue.Empty:
                    worker.check_health(HEALTH_STALE_S)
                    continue
                line = rollout_line(sample.group_id, sample.completion_mask, sample.input_ids, stop_ids, group_ids)
                append_rollout(out, **line, t=time.time())
                delivered[sample.group_id] = delivered.get(sample.group_id, 0) + 1
                finished += delivered[sample.group_id] == job.group_size
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
