"""How busy the pipeline keeps its inference servers: the share of the run's wall time each embedded
server had at least one sequence running (`beam_rl:busy_seconds`), and rollouts/s end to end.

    python -m bench.throughput.server_busy [--mode model|instant] [--prompts 32] [--group-size 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import httpx

from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.job.rollouts import run_rollouts


def _busy_seconds(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("beam_rl:busy_seconds_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{url}/metrics has no beam_rl:busy_seconds_total")


def measure(mode: str, prompts: int, group_size: int, rollouts_per_step: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix="busy-")
    config = config_from_dict({
        "run": {"dir": run_dir, "max_steps": 10_000},
        "envs": [{"name": "reverse_text", "group_size": group_size, "limit": prompts}],
        "batch": {"rollouts_per_step": rollouts_per_step},
        "inference": {"max_tokens": 8, "max_inflight": 64},
        "filters": {"zero_advantage": {"mode": "monitor"}},
    })
    servers = [EmbeddedServer(model_dir=tiny_model_dir(), mode=mode, served_model_name="tiny", max_num_seqs=64)
               for _ in range(2)]
    urls = [s.start() for s in servers]
    try:
        started = time.monotonic()
        run_rollouts(config, urls, with_trainer=False)
        wall = time.monotonic() - started
        busy = [_busy_seconds(url) for url in urls]
    finally:
        for s in servers:
            s.stop()
    committed = RunDir(run_dir)
    windows = [committed.read_window(s) for s in committed.committed_steps()]
    rollouts = sum(w.num_rows for w in windows)
    # The dispatch span: first rollout started to last one finished (start-up and drain excluded).
    span = (max(max(w.column("t_finished").to_pylist()) for w in windows)
            - min(min(w.column("t_sent").to_pylist()) for w in windows))
    return {"mode": mode, "rollouts": rollouts, "wall_s": round(wall, 2), "dispatch_span_s": round(span, 2),
            "rollouts_per_s_wall": round(rollouts / wall, 1), "rollouts_per_s_dispatch": round(rollouts / span, 1),
            "server_busy_share_of_wall": [round(b / wall, 3) for b in busy],
            "server_busy_share_of_dispatch": [round(b / span, 3) for b in busy]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", default="model", choices=("model", "instant"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rollouts-per-step", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(measure(args.mode, args.prompts, args.group_size, args.rollouts_per_step), indent=2))


if __name__ == "__main__":
    main()
