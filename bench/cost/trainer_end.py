"""The trainer end's figures (issue 32): a step's time on 1 process against 2 data-parallel gloo ranks, and what a
weight update costs per step with whole weights against a LoRA adapter (bytes published, time to publish, time for
a server to load, engine time a keep update stalls), side by side in one run:

    .venv/bin/python -m bench.cost.trainer_end --out bench/cost/trainer_end.json

The model is Llama-shaped with random weights (~3M parameters, built offline), big enough that whole weights
and an adapter differ the way they do for real models; the steps are synthetic (random tokens, advantages of
both signs), packed for two ranks as the packer packs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from beam_rl.config import LoraSection, TrainerSection
from beam_rl.inference.client import InferenceClient
from beam_rl.inference.types import SamplingParams
from beam_rl.packing.packer import pack_for_ranks
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tiny import write_llama_model
from beam_rl.trainer import data_parallel
from beam_rl.trainer.reference import run_trainer
from beam_rl.types import Sample, TrainBatch

LORA = LoraSection(rank=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
RANKS = 2


def write_steps(run: RunDir, steps: int, samples: int, length: int, vocab: int) -> None:
    """Synthetic committed steps: half prompt, half completion, logprobs of -3 (the ratio is not 1, so the
    clipped loss does its whole work)."""
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        batch = []
        for i in range(samples):
            ids = rng.integers(10, vocab, size=length).astype(np.int32)
            mask = np.arange(length) >= length // 2
            batch.append(Sample(input_ids=ids, loss_mask=mask, logprobs=np.where(mask, -3.0, 0.0).astype(np.float32),
                                advantages=np.where(mask, 1.0 if i % 2 else -1.0, 0.0).astype(np.float32),
                                temperatures=np.ones(length, np.float32), rollout_id=f"s{step}-{i}",
                                group_id=f"s{step}-{i // 4}", policy_version=step - 1, reward=float(i % 2)))
        micro_batches = pack_for_ranks(batch, seq_len=4 * length, ranks=RANKS)
        run.write_step(TrainBatch(step=step, micro_batches=micro_batches,
                                  group_ids=sorted({s.group_id for s in batch}), window={}))


def trained(run: RunDir) -> list[dict[str, Any]]:
    return [m["trainer"] for m in run.read_metrics() if "trainer" in m]


def data_parallel_figures(model_dir: Path, work: Path, steps: int, samples: int, length: int, vocab: int) -> dict:
    runs = {}
    for nproc in (1, RANKS):
        run = RunDir(work / f"dp-{nproc}")
        write_steps(run, steps, samples, length, vocab)
        started = time.monotonic()
        if nproc == 1:
            torch.set_num_threads(1)
            run_trainer(run, model_dir, TrainerSection(), max_steps=steps)
        else:
            data_parallel.launch(run.path, model_dir, TrainerSection(), max_steps=steps, nproc=nproc)
        metrics = trained(run)[1:]  # the first step warms up (allocations, the process group)
        compute = statistics.median(m["compute_s"] for m in metrics)
        tokens = statistics.median(m["tokens"] for m in metrics)
        runs[nproc] = {"processes": nproc, "wall_s": round(time.monotonic() - started, 2),
                       "step_compute_s_median": round(compute, 3), "tokens_per_step": tokens,
                       "tokens_per_s_per_rank": round(tokens / compute / nproc, 1)}
    return {"runs": runs, "speedup": round(runs[1]["step_compute_s_median"] / runs[RANKS]["step_compute_s_median"], 2)}


def publish_figures(model_dir: Path, work: Path, vocab: int) -> dict[str, dict]:
    out = {}
    for kind, lora in (("whole", None), ("lora", LORA)):
        run = RunDir(work / f"publish-{kind}")
        write_steps(run, 3, 8, 64, vocab)
        torch.set_num_threads(1)
        metrics = run_trainer(run, model_dir, TrainerSection(lora=lora), max_steps=3)
        path = run.weights_path(3)
        out[kind] = {"path": path, "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
                     "publish_s_median": round(statistics.median(m["publish_s"] for m in metrics), 4)}
    return out


def update_figures(model_dir: Path, published: dict[str, dict], updates: int = 5) -> dict[str, dict]:
    """Each checkpoint loaded `updates` times in keep mode while 8 requests keep the server's engine busy."""
    out = {}
    for kind, figures in published.items():
        lora = kind == "lora"
        with EmbeddedServer(model_dir, served_model_name="m", max_num_seqs=16, enable_lora=lora) as server:
            timings = asyncio.run(_updates_under_load(server, figures["path"], lora, updates))
        load_s = statistics.median(t.reload_s for t in timings)
        paused_s = statistics.median(t.paused_s for t in timings)
        # What keeps the engine from stepping: a keep update's pause (the load inside it) for whole weights; for
        # an adapter, no pause, only the load's own time on the model thread, between two steps.
        out[kind] = {"load_s_median": round(load_s, 4), "paused_s_median": round(paused_s, 4),
                     "engine_blocked_s_median": round(load_s if lora else paused_s, 4)}
    return out


async def _updates_under_load(server: EmbeddedServer, path: Path, lora: bool, updates: int):
    async with InferenceClient(server.url, model="m", stream=True, lora=lora) as client:
        stop = asyncio.Event()

        async def busy(seed: int) -> None:
            while not stop.is_set():
                await client.complete([5, 6, 7, 8], SamplingParams(max_tokens=64, seed=seed))

        load = [asyncio.ensure_future(busy(i)) for i in range(8)]
        await asyncio.sleep(1.0)
        timings = []
        for version in range(1, updates + 1):
            timings.append(await client.update_weights(path, version, "keep"))
            await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*load)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/cost/trainer_end.json")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = write_llama_model(work / "model", hidden_size=256, num_hidden_layers=4)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
            str(model_dir)).parameters())
        dp = data_parallel_figures(model_dir, work, args.steps, args.samples, args.length, vocab)
        published = publish_figures(model_dir, work, vocab)
        updates = update_figures(model_dir, published)
    result = {
        "command": "python -m bench.cost.trainer_end " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "model": {"architecture": "LlamaForCausalLM", "parameters": params},
        "data_parallel": dp,
        "weight_update": {kind: {k: v for k, v in published[kind].items() if k != "path"} | updates[kind]
                          for kind in published},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
