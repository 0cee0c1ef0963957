"""The packer's ceiling: how many steps and rollouts a second the single-key packer and the step writer
number and commit, with nothing upstream to wait for (issue 30: the packer numbers every step on one key).

    python -m bench.scale.packer [--steps 40] [--runners direct,flink-local] [--out bench/scale/packer.json]

Scored groups of 8 rollouts of 256 tokens (32 prompt + 224 completion; bench/scale/pack_state.py makes them), 256
rollouts a step, are made up front and fed to the same two stages a run ends with (`PackBatches`, then
`WriteTrainBatches`: the files of each step written keyed by (step, file), then its commit record) on each
runner, from a bounded source that has them all at once. The rate is every step's rollouts over the time
from the first file any step wrote (its mtime) to the last commit record's `committed_at`: runner start-up
and the packer's first cut are left out. Without Beam, fed lists of `BATCH_GROUPS` groups as a backlog reaches the packer, state
pickled as a runner stores it: `in_process` runs the packer's key (`_PackFn.process`, the split into files,
and encoding what leaves the key), then the file writers and the committer, one after the other in one
thread; `one_key` the key as it was before it only cut, writing each step itself (`RunDir.write_step`).
Each reports the key's CPU per rollout (its thread's CPU time).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import apache_beam as beam
import numpy as np

from beam_rl.config import RunConfig, config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch
from bench.scale.pack_state import GROUP_SIZE, StoredBag, StoredValue, scored_group
from runners.job_server import start_job_server
from runners.options import RunnerSettings, pipeline_options
from transforms.coders import DomainCoder
from transforms.pack import BATCH_GROUPS, PackBatches, _PackFn
from transforms.write import WriteTrainBatches, _CommitFn, _plan, _split, _WriteFileFn

ROLLOUTS_PER_STEP = 256


def _config(run_dir: str, steps: int) -> RunConfig:
    return config_from_dict({
        "run": {"dir": run_dir, "max_steps": steps},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
    })


def _rate(run_dir: RunDir) -> dict:
    """Every step's rollouts over the time from the first file any step wrote to the last commit: with the
    files written apart from their commits, a span from step 1's commit would leave out the files written
    before it."""
    steps = run_dir.committed_steps()
    first = min(path.stat().st_mtime for path in run_dir.rollouts_dir.glob("step_*/*.arrow"))
    last = run_dir.read_commit(steps[-1]).committed_at
    rollouts = len(steps) * ROLLOUTS_PER_STEP
    return {"steps": len(steps), "seconds": round(last - first, 3),
            "steps_per_s": round(len(steps) / (last - first), 2),
            "rollouts_per_s": round(rollouts / (last - first), 1)}


def in_process(groups: list, steps: int) -> dict:
    """The packer's key (`_PackFn.process`, splitting each step into its files, and encoding what leaves
    the key as a runner does), then the file writers and the committer, one after the other in one
    thread; the key's CPU per rollout is its thread's CPU time."""
    with tempfile.TemporaryDirectory(prefix="bench-packer-") as tmp:
        pack, write, commit = (
            _PackFn(_config(tmp, steps), 1, check_staleness=False, run_dir=tmp), _WriteFileFn(tmp), _CommitFn(tmp)
        )
        for fn in (pack, write, commit):
            fn.setup()
        state, pending, parts, coder = StoredValue(), StoredBag(), StoredBag(), DomainCoder()
        key_cpu = 0.0
        for start in range(0, len(groups), BATCH_GROUPS):  # as a backlog reaches the packer: full lists
            t0 = time.thread_time()
            out = [coder.encode(part)
                   for batch in pack.process(("packer", groups[start:start + BATCH_GROUPS]), state=state, pending=pending)
                   for part in _split(batch)]
            key_cpu += time.thread_time() - t0
            for encoded in out:
                for item in write.process(coder.decode(encoded)):
                    list(commit.process(item, parts=parts))
        rate = _rate(RunDir(tmp))
        return {**rate, "key_cpu_us_per_rollout": round(key_cpu / (steps * ROLLOUTS_PER_STEP) * 1e6, 1)}


def one_key(groups: list, steps: int) -> dict:
    """The packer's key as it was before it only cut: `_PackFn.process`, then each step's files and its
    commit record written on the key itself (`RunDir.write_step`), all of it the key's CPU."""
    with tempfile.TemporaryDirectory(prefix="bench-packer-") as tmp:
        pack, run_dir = _PackFn(_config(tmp, steps), 1, check_staleness=False, run_dir=tmp), RunDir(tmp)
        pack.setup()
        state, pending = StoredValue(), StoredBag()
        key_cpu = 0.0
        for start in range(0, len(groups), BATCH_GROUPS):
            t0 = time.thread_time()
            for batch in pack.process(("packer", groups[start:start + BATCH_GROUPS]), state=state, pending=pending):
                if isinstance(batch, TrainBatch):
                    plan = _plan(batch)
                    run_dir.write_step(batch, offsets=plan.offsets, extra=plan.extra)
            key_cpu += time.thread_time() - t0
        rate = _rate(run_dir)
        return {**rate, "key_cpu_us_per_rollout": round(key_cpu / (steps * ROLLOUTS_PER_STEP) * 1e6, 1)}


def on_runner(groups: list, steps: int, runner: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-packer-") as tmp:
        server = start_job_server("[local]", Path(tmp) / "job-server.log", 1024) if runner == "flink-local" else None
        try:
            settings = RunnerSettings(name=runner, job_endpoint=server.endpoint if server else None)
            with beam.Pipeline(options=pipeline_options(settings)) as p:
                _ = (p | beam.Create(groups, reshuffle=False)
                     | PackBatches(_config(tmp, steps), 1, False, tmp)
                     | WriteTrainBatches(tmp))
        finally:
            if server is not None:
                server.stop()
        return _rate(RunDir(tmp))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runners", default="direct,flink-local")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    groups = [scored_group(i, rng, flat=False) for i in range(args.steps * ROLLOUTS_PER_STEP // GROUP_SIZE)]
    results = {"one_key": one_key(groups, args.steps), "in_process": in_process(groups, args.steps)}
    print(f"one_key: {results['one_key']}\nin_process: {results['in_process']}", flush=True)
    for runner in args.runners.split(","):
        results[runner] = on_runner(groups, args.steps, runner)
        print(f"{runner}: {results[runner]}", flush=True)
    out = {"command": f"python -m bench.scale.packer --steps {args.steps} --runners {args.runners}",
           "rollouts_per_step": ROLLOUTS_PER_STEP, "group_size": GROUP_SIZE, "tokens_per_rollout": 256,
           "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
