"""Figure 6: the train sink's throughput (tokens/s tokenized into samples, packed, written as Arrow)
and Arrow write bandwidth against a plain sequential write of the same bytes (both fsynced)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from beam_rl import wiring
from beam_rl.model.location import tokenizer_for
from beam_rl.rundir import RunDir
from beam_rl.scoring.group import score_group
from beam_rl.standin.generator import InstantGenerator
from bench.common.pipeline import ENV, bench_config, instant_rollouts


def _plain_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def measure(size: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-sink-") as run_dir:
        config = bench_config(run_dir, ["http://unused"], size, "direct")
        envs = wiring.build_envs(config)
        tokenizer = tokenizer_for(config.model.name)
        generator = InstantGenerator(len(tokenizer), set(tokenizer.all_special_ids))
        schedule = wiring.build_schedule(config, envs)
        algorithm, filters = wiring.algorithms(config)[ENV], wiring.pre_batch_filters(config)
        groups_total = size["sink_rollouts"] // size["group_size"]
        groups = [instant_rollouts(config, envs[ENV], generator, p, schedule) for p in range(groups_total)]
        builder = wiring.batch_builder(config, 1, check_staleness=False)
        rundir = RunDir(run_dir)
        t_score = t_pack = t_write = 0.0
        tokens = 0
        for rollouts in groups:
            t0 = time.perf_counter()
            scored = score_group(rollouts, algorithm, filters, config.inference.temperature)  # incl. trace_to_samples
            t1 = time.perf_counter()
            batches = builder.add(scored)  # cut, pack into micro-batches, balance over ranks
            t2 = time.perf_counter()
            for batch in batches:
                tokens += sum(mb.num_tokens for rank in batch.micro_batches for mb in rank)
                rundir.write_step(batch, window=batch.rollouts)
            t3 = time.perf_counter()
            t_score, t_pack, t_write = t_score + t1 - t0, t_pack + t2 - t1, t_write + t3 - t2
        files = [p for s in rundir.committed_steps() for p in rundir.step_dir(s).glob("*.arrow")]
        payload = b"".join(p.read_bytes() for p in files)
        # Arrow bandwidth: the rank files alone, written the way write_step writes them (table -> IPC, fsync).
        plain_dir = tempfile.mkdtemp(dir=run_dir)
        t0 = time.perf_counter()
        for i, p in enumerate(files):
            _plain_write(os.path.join(plain_dir, f"{i}.bin"), p.read_bytes())
        plain_s = time.perf_counter() - t0 - 0.0
        t0 = time.perf_counter()
        for i, p in enumerate(files):
            p.read_bytes()
        read_s = time.perf_counter() - t0  # reading back is part of the plain loop above; subtract it
        plain_s = max(plain_s - read_s, 1e-9)
        total = t_score + t_pack + t_write
        return {
            "rollouts": sum(len(g) for g in groups),
            "steps": len(rundir.committed_steps()),
            "tokens": tokens,
            "tokens_per_s": round(tokens / total, 1),
            "seconds": {"tokenize_score": round(t_score, 4), "pack": round(t_pack, 4), "write": round(t_write, 4)},
            "bytes_written": len(payload),
            "arrow_write_mb_per_s": round(len(payload) / t_write / 2**20, 1),
            "plain_write_mb_per_s": round(len(payload) / plain_s / 2**20, 1),
            "arrow_vs_plain": round((len(payload) / t_write) / (len(payload) / plain_s), 3),
        }
