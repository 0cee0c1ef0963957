"""Environments mixed by target share (`envs[].ratio`), realized against target, one run per variant on this
machine: two arithmetic environments, `a` with one group in ten dropped by the zero-advantage filter and `b`
with four in ten (the server answers 7 and 8 in turn: a row whose answer is 7 makes a mixed group, one whose
answer it never gives makes an all-zero group). A stand-in trainer publishes weights as each step commits,
so admission runs as far ahead of training as in a real run.

    .venv/bin/python -m bench.learning.mixing --steps 40 --out bench/learning/mixing.json

Reported per variant, from the committed steps' rank files: each environment's share of trained samples
(and tokens) against its target, and its share of the groups consumed (the acceptance correction at work).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.source.mixing import trained_by_env
from bench.common.results import write_results

GROUP = 4
FILTERED_OF_10 = {"a": 1, "b": 4}
REPLIES = [{"text": "7", "latency_s": 0.05}, {"text": "8", "latency_s": 0.05}]
VARIANTS: dict[str, dict[str, Any]] = {
    "turns (no ratio)": {"ratios": None},
    "3:1 samples": {"ratios": {"a": 3.0, "b": 1.0}},
    "1:1 samples": {"ratios": {"a": 1.0, "b": 1.0}},
    "1:3 samples": {"ratios": {"a": 1.0, "b": 3.0}},
    "3:1 tokens": {"ratios": {"a": 3.0, "b": 1.0}, "mix_by": "tokens"},
}


def write_dataset(directory: Path, rows: int, filtered_of_10: int) -> Path:
    """Sums whose answer is 7 but for `filtered_of_10` rows in ten, whose answer is one never given."""
    directory.mkdir(parents=True)
    lines = [{"question": f"{i} + ?", "answer": "99" if i % 10 < filtered_of_10 else "7"} for i in range(rows)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return directory


def mixed_config(run_dir: Path, data: Path, steps: int, ratios: dict[str, float] | None, *, shards: int = 1,
                 mix_by: str = "samples", rollouts_per_step: int = 16) -> dict[str, Any]:
    """The run of two environments `a` and `b`, at `ratios` (None: taking turns), as a config dict."""
    envs = []
    for name, filtered in FILTERED_OF_10.items():
        envs.append({"name": name, "kind": "arithmetic", "group_size": GROUP, "epochs": 1000,
                     "args": {"dataset": str(write_dataset(data / name, 40, filtered))},
                     **({"ratio": ratios[name]} if ratios else {})})
    return {
        "run": {"dir": str(run_dir), "max_steps": steps},
        "envs": envs,
        "model": {"max_context": 256},
        "batch": {"rollouts_per_step": rollouts_per_step, "seq_len": 256},
        "inference": {"max_tokens": 8, "max_inflight": rollouts_per_step},
        "runner": {"name": "direct"},
        "dispatch": {"shards": shards, "mix_by": mix_by},
    }


def run(config_dict: dict[str, Any]) -> None:
    """The run to its end, on one embedded server per shard answering REPLIES, beside a stand-in trainer."""
    from beam_rl.standin.faults import FaultConfig
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir
    from bench.common.trainer import PublishEveryStep
    from beam_rl.job.rollouts import run_rollouts

    config = config_from_dict(config_dict)
    run_dir = RunDir(config.run.dir)
    run_dir.write_config(config.model_dump(mode="json"))  # as `beam-rl run` does: inspect reads it
    servers = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny",
                              max_num_seqs=config.inference.max_inflight,
                              faults=FaultConfig(replies=REPLIES)) for _ in range(config.dispatch.shards)]
    trainer = PublishEveryStep(run_dir)
    trainer.start()
    try:
        run_rollouts(config, [server.start() for server in servers], with_trainer=True)
    finally:
        trainer.stop.set()
        trainer.join(10)
        for server in servers:
            server.stop()


def shares(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    """Per environment, from the committed steps: trained samples and tokens, groups consumed, and shares."""
    counts: dict[str, collections.Counter[str]] = {by: collections.Counter() for by in ("samples", "tokens", "groups")}
    for step in run_dir.committed_steps():
        record = run_dir.read_commit(step)
        for by in ("samples", "tokens"):
            counts[by].update(trained_by_env(run_dir, record, by))
        counts["groups"].update(env for env, _, _ in record.offsets)
    return {env: {**{by: counts[by][env] for by in counts},
                  **{f"{by}_share": round(counts[by][env] / max(1, sum(counts[by].values())), 4) for by in counts}}
            for env in FILTERED_OF_10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    console = Console()
    report: dict[str, Any] = {"steps": args.steps, "filtered_of_10": FILTERED_OF_10, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, variant) in enumerate(VARIANTS.items()):
            root = Path(tmp) / str(i)
            started = time.monotonic()
            ratios = variant["ratios"]
            run(mixed_config(root / "run", root / "data", args.steps, ratios, mix_by=variant.get("mix_by", "samples")))
            by = variant.get("mix_by", "samples")
            result = shares(RunDir(root / "run"))
            target = {env: (ratios[env] / sum(ratios.values()) if ratios else None) for env in FILTERED_OF_10}
            report["variants"][name] = {"mix_by": by, "target": target, "envs": result,
                                        "seconds": round(time.monotonic() - started, 1)}
            line = ", ".join(f"{env} {result[env][f'{by}_share']:.3f} of trained {by}"
                             + (f" (target {target[env]:.3f})" if target[env] is not None else "")
                             + f", {result[env]['groups_share']:.3f} of groups" for env in result)
            console.print(f"{name}: {line}")
    if args.out:
        write_results(args.out, report)


if __name__ == "__main__":
    main()
