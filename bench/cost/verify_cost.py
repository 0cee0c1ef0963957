"""What checksumming committed files costs: hash functions next to writing and fsyncing 64 MiB, and a
verified read of a 64 MiB rank file next to an unverified one (mapping it alone, and `StepReader.read_step`),
warm and cold.

    .venv/bin/python -m bench.cost.verify_cost [--mib 64] [--rounds 7]

Cold reads evict the rank file's pages with posix_fadvise(DONTNEED) (that file only); rounds interleave
the variants so drift hits them alike. Prints one JSON object; times are medians in ms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np
import xxhash

from beam_rl.rundir import RunDir
from beam_rl.trainer.reader import StepReader
from beam_rl.types import MicroBatch, Sample, TrainBatch
from schemas.fields import TOKEN_FIELDS

SAMPLE_TOKENS = 2048
SAMPLES_PER_MICRO_BATCH = 8
BYTES_PER_TOKEN = sum(f.dtype.itemsize for f in TOKEN_FIELDS)  # a token's values in a rank file


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 2)


def hashes_vs_fsync(mib: int, rounds: int, directory: str) -> dict[str, float]:
    data = np.random.default_rng(0).integers(0, 256, size=mib * 2**20, dtype=np.uint8).tobytes()
    path = os.path.join(directory, "plain.bin")

    def write_fsync() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return {
        "sha256": _median_ms(lambda: hashlib.sha256(data).hexdigest(), rounds),
        "blake2b": _median_ms(lambda: hashlib.blake2b(data).hexdigest(), rounds),
        "crc32": _median_ms(lambda: zlib.crc32(data), rounds),
        "xxh3_128": _median_ms(lambda: xxhash.xxh3_128(data).hexdigest(), rounds),
        "write_fsync": _median_ms(write_fsync, rounds),
    }


def rank_file_batch(mib: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(mib * 2**20 // (SAMPLE_TOKENS * BYTES_PER_TOKEN)):
        mask = np.arange(SAMPLE_TOKENS) >= SAMPLE_TOKENS // 4
        samples.append(Sample(
            input_ids=rng.integers(0, 150_000, SAMPLE_TOKENS, dtype=np.int32), loss_mask=mask,
            logprobs=rng.normal(size=SAMPLE_TOKENS).astype(np.float32),
            advantages=np.where(mask, 0.5, 0.0).astype(np.float32), temperatures=np.ones(SAMPLE_TOKENS, np.float32),
            rollout_id=f"g{i // 8}/{i % 8}", group_id=f"g{i // 8}", policy_version=0))
    micro_batches = [MicroBatch(samples[i:i + SAMPLES_PER_MICRO_BATCH])
                     for i in range(0, len(samples), SAMPLES_PER_MICRO_BATCH)]
    return TrainBatch(step=1, micro_batches=[micro_batches], group_ids=sorted({s.group_id for s in samples}), window={})


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def reads(mib: int, rounds: int, directory: str) -> dict[str, float]:
    run = RunDir(directory)
    run.write_step(rank_file_batch(mib))
    path = str(run.rank_path(1, 0))
    verified, unverified = StepReader(run, verify=True), StepReader(run, verify=False)

    def read_and_touch(reader: StepReader) -> None:
        # What a trainer does next: every token array is read once.
        for mb in reader.read_step(1):
            for name in ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "temperatures"):
                mb[name].sum()

    record = run.read_commit(1)
    variants = {
        "warm_map_verified": lambda: run.map_committed_file(record, "rank_0.arrow", verify=True),
        "warm_map_unverified": lambda: run.map_committed_file(record, "rank_0.arrow", verify=False),
        "warm_verified": lambda: verified.read_step(1),
        "warm_unverified": lambda: unverified.read_step(1),
        "cold_verified_then_touch_all": lambda: read_and_touch(verified),
        "cold_unverified_then_touch_all": lambda: read_and_touch(unverified),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if name.startswith("cold"):
                _evict(path)
            else:
                fn()  # warm the page cache
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    result = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    for kind in ("warm_map", "warm", "cold"):  # paired per round: what verifying added to the same read
        verified_t = next(t for name, t in times.items() if name.startswith(f"{kind}_verified"))
        unverified_t = next(t for name, t in times.items() if name.startswith(f"{kind}_unverified"))
        result[f"{kind}_added_by_verify"] = round(1e3 * statistics.median(
            v - u for v, u in zip(verified_t, unverified_t)), 2)
    result["rank_file_mib"] = round(os.path.getsize(path) / 2**20, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir=os.environ.get("BENCH_DIR")) as directory:
        result = {"hash_64mib_vs_write_fsync_ms": hashes_vs_fsync(args.mib, args.rounds, directory),
                  "read_step_ms": reads(args.mib, args.rounds, os.path.join(directory, "run"))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
