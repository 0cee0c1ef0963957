"""How long the trainer waits on rewards in the tiny run (configs/tiny.toml, `beam-rl run`) when an LLM
judge that takes `--latency-s` per answer replaces the reward (at each `reward.concurrency` level given),
side by side with the judge off, in one script run: the trainer's `wait_s` per step (metrics.jsonl), the
run's wall time, and how many groups the scoring stage's bundles held.

The judge is an OpenAI-compatible endpoint on 127.0.0.1 that grades exactly as arithmetic_easy's own
reward does (from the answer and the completion in its prompt), so both runs learn from the same rewards
and differ only in when those rewards arrive.

    .venv/bin/python -m bench.rewards.judge_wait --latency-s 1 --concurrency 64,256 --out bench/rewards/judge_wait.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import io
import json
import os
import re
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from rich.console import Console
from rich.table import Table

from beam_rl.config import RunConfig, load_config
from beam_rl.envs.arithmetic import first_integer
from beam_rl.rundir import RunDir
from bench.rewards import reward_stage
from bench.common.results import write_results
from beam_rl.job.run import run_job

PROMPT = "Grade the answer to a sum.\nanswer: {answer}\ncompletion: {completion!r}"
_GRADED = re.compile(r"answer: (-?[0-9]+)\ncompletion: (.*)\Z", re.DOTALL)


class GradingJudge:
    """/v1/chat/completions answering "SCORE: <arithmetic_easy's reward>" after `latency_s`."""

    def __init__(self, latency_s: float, partial_credit: float = 0.1) -> None:
        self.latency_s, self.partial_credit = latency_s, partial_credit
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grading-judge")
        self.url = ""

    def grade(self, answer: str, text: str) -> float:
        predicted = first_integer(text)  # what Arithmetic.reward does with the same final text
        if predicted is None:
            return 0.0
        return 1.0 if predicted == int(answer) else self.partial_credit

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.json()
        answer, completion = _GRADED.search(body["messages"][-1]["content"]).groups()
        await asyncio.sleep(self.latency_s)
        score = self.grade(answer, ast.literal_eval(completion))
        message = {"role": "assistant", "content": f"SCORE: {score}"}
        return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    def __enter__(self) -> GradingJudge:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self._chat)])
        runner = web.AppRunner(app, access_log=None)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread.start()

        async def start() -> None:
            await runner.setup()
            await web.SockSite(runner, sock).start()

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=30)
        self._runner = runner
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def configured(base: RunConfig, run_dir: Path, judge_url: str | None = None, concurrency: int = 64) -> RunConfig:
    data = base.model_dump(mode="json")
    data["run"]["dir"] = str(run_dir)
    if judge_url is not None:
        for env in data["envs"]:
            env["reward"]["concurrency"] = concurrency
            env["reward"]["judge"] = {"url": judge_url, "model": "grader", "prompt": PROMPT,
                                      "verdict": {"pattern": r"SCORE: ([0-9.]+)"}, "timeout_s": 30.0}
    return RunConfig.model_validate(data)


def one_run(config: RunConfig) -> dict[str, Any]:
    reward_stage._BUNDLES.clear()
    started = time.monotonic()
    run_job(config, console=Console(file=io.StringIO()))  # LOOPBACK: the scoring stage runs in this process
    wall_s = time.monotonic() - started
    run_dir = RunDir(config.run.dir)
    trainer = [line["trainer"] for line in map(json.loads, run_dir.metrics_path.read_text().splitlines())
               if "trainer" in line]
    waits = [m["wait_s"] for m in trainer]
    records = [run_dir.read_commit(step) for step in run_dir.committed_steps()]
    bundles = list(reward_stage._BUNDLES)
    return {
        "run_dir": str(run_dir.path), "wall_s": round(wall_s, 1), "steps": len(trainer),
        "wait_s_per_step": [round(w, 3) for w in waits],
        # Step 1's wait includes the pipeline's and the servers' start-up: reported apart.
        "first_step_wait_s": round(waits[0], 2),
        "later_steps_wait_s_total": round(sum(waits[1:]), 2),
        "later_steps_wait_s_median": round(statistics.median(waits[1:]), 3),
        "compute_s_median": round(statistics.median(m["compute_s"] for m in trainer), 3),
        "reward_mean_first5": round(statistics.mean(m["reward_mean"] for m in trainer[:5]), 3),
        "reward_mean_last5": round(statistics.mean(m["reward_mean"] for m in trainer[-5:]), 3),
        "reward_errors": sum(r.window.status.get("reward_error", 0) for r in records),
        # Rollouts that waited for their rewards are older when packed: how many the staleness bound dropped.
        "window_rollouts": sum(r.window.rollouts for r in records),
        "trained_rollouts": sum(r.window.trained_rollouts for r in records),
        "stale_rollouts": sum(r.window.filtered.get("stale", 0) for r in records),
        "scoring_bundles": len(bundles),
        "groups_per_bundle_mean": round(statistics.mean(bundles), 2) if bundles else None,
        "groups_per_bundle_max": max(bundles) if bundles else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--latency-s", type=float, default=1.0, help="the judge's time per answer")
    parser.add_argument("--concurrency", default="64,256", help="reward.concurrency levels of the judged runs")
    parser.add_argument("--work-dir", default="runs/bench-judge-wait", help="the two runs' directories go here")
    parser.add_argument("--out", default="bench/rewards/judge_wait.json")
    args = parser.parse_args()
    base = load_config(args.config)
    work = Path(args.work_dir)
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work} is not empty: remove it or pass another --work-dir")
    reward_stage.count_bundles()
    report: dict[str, Any] = {"config": args.config, "judge_latency_s": args.latency_s,
                              "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}}
    report["judge_off"] = one_run(configured(base, work / "judge_off"))
    levels = [int(c) for c in args.concurrency.split(",")]
    for concurrency in levels:
        with GradingJudge(args.latency_s) as judge:
            name = f"judge_concurrency_{concurrency}"
            report[name] = one_run(configured(base, work / name, judge.url, concurrency))
            report[name]["judge_requests"] = judge.requests
    runs = ["judge_off", *(f"judge_concurrency_{c}" for c in levels)]
    table = Table("", "judge off", *(f"judge {args.latency_s:g} s, {c} in flight" for c in levels),
                  title=f"trainer wait on rewards, {args.config}")
    for key in ("wall_s", "steps", "first_step_wait_s", "later_steps_wait_s_total", "later_steps_wait_s_median",
                "compute_s_median", "reward_mean_first5", "reward_mean_last5", "reward_errors", "window_rollouts",
                "trained_rollouts", "stale_rollouts", "scoring_bundles",
                "groups_per_bundle_mean", "groups_per_bundle_max"):
        table.add_row(key, *(str(report[run][key]) for run in runs))
    Console().print(table)
    write_results(args.out, report)


if __name__ == "__main__":
    main()
