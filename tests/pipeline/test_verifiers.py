"""A verifiers (v1) taskset's own reward functions scoring beam-rl rollouts, through the `verifiers`
environment: offline (the adapter's contract, in a process of its own), and inside the rollout pipeline,
whose scoring workers import verifiers.v1 on Prism (and on a standalone Flink cluster's worker pools:
tests/runners/test_flink_cluster.py, which shares its cluster).

verifiers 0.4.0 is an ordinary dependency since Beam 2.70 (protobuf < 7; verifiers needs >= 6.31 through
prime-sandboxes). Under Beam 2.62 (protobuf < 6) the two could not be imported in one process.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.timeout(300)

TASKSET = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def concise(self, trace) -> float:
        if trace.last_reply == "raise":
            raise RuntimeError("grader crashed")
        return 1.0 if len(trace.last_reply) <= 4 else 0.0


class Sums(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(1, 2), (30, 12), (7, 8)]:
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with a number.",
                                  answer=str(a + b)))


class SandboxTask(SumTask):
    @vf.reward
    async def passes_tests(self, trace, runtime) -> float:
        return 1.0


class NeedsSandbox(vf.Taskset[SandboxTask, vf.TasksetConfig]):
    def load(self):
        yield SandboxTask(SumData(prompt="2 + 2?", answer="4"))
'''

DRIVER = '''
import asyncio, json, sys
from beam_rl.envs import make_env
from beam_rl.envs.base import Completion, SamplingParams
from beam_rl.scoring.rewards import assign_rewards
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import Rollout

import apache_beam  # noqa: F401  (Beam and verifiers share one process and one protobuf now)

tok = load_tokenizer("tiny")
env = make_env("verifiers", tok, taskset="sums:Sums")
rows = env.load_rows("train")


class Client:
    def __init__(self, answers):
        self.answers = answers

    async def complete(self, prompt_ids, sampling, n=1):
        ids = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in self.answers]
        return [Completion(i, [0.0] * len(i), "stop") for i in ids[:n]]


out = {"rows": rows, "prompts": [], "rewards": [], "errors": []}
for row in rows:
    prompt = env.render_prompt(row)
    out["prompts"].append(tok.decode(prompt))
    answers = [row["answer"], "I think it is " + row["answer"], "99", "raise"]
    trajectories = asyncio.run(env.run_group(Client(answers), row, prompt, SamplingParams(), n=4))
    rollouts = [Rollout("g", "verifiers", i, 4, prompt_ids=prompt, turns=t.turns, info=t.info, row=row)
                for i, t in enumerate(trajectories)]
    assign_rewards(rollouts, env)
    out["rewards"].append([r.reward if r.ok else None for r in rollouts])
    out["errors"].append([r.errors for r in rollouts])
try:
    make_env("verifiers", tok, taskset="sums:NeedsSandbox")
except ValueError as exc:
    out["refused"] = str(exc)
import google.protobuf
out["protobuf"] = google.protobuf.__version__
print(json.dumps(out))
'''


def test_a_tasksets_own_rewards_score_beam_rl_rollouts(tmp_path: Path) -> None:
    (tmp_path / "sums.py").write_text(textwrap.dedent(TASKSET))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py")], env=env, capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert [(r["prompt"], r["answer"], r["idx"]) for r in out["rows"]] == [
        ("What is 1 + 2?", "3", 0), ("What is 30 + 12?", "42", 1), ("What is 7 + 8?", "15", 2)]
    assert out["prompts"][1] == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                                 "<|im_start|>user\nWhat is 30 + 12?<|im_end|>\n<|im_start|>assistant\n")
    # correct (weight 1) + concise (weight 0.5), as verifiers sums them; a crashing reward masks the rollout.
    assert out["rewards"] == [[1.5, 0.0, 0.5, None]] * 3  # exact answer; wordy; short but wrong; crashed
    assert all(errors[3] == ["RewardUnavailable: verifiers scoring failed: task SumTask scoring: RuntimeError: "
                             "grader crashed"] for errors in out["errors"])
    assert out["refused"] == ("verifiers rewards ['passes_tests'] need a runtime (a sandbox); "
                              "this adapter scores offline")
    assert out["protobuf"].startswith("6.")


# -- in the pipeline: the scoring workers import verifiers.v1 and run the taskset's reward ---------------

PIPELINE_TASKSET = '''
import os
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def answer_value(self, task) -> float:
        # The row's own answer as the reward: the window shows which row each group was scored for. The
        # completion adds 0.5 when it is empty, which the instant server's never are.
        return float(task.answer)

    @vf.reward(weight=0.5)
    async def empty(self, trace) -> float:
        return float(trace.last_reply == "")


class Echo(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for i in range(PROMPTS):
            yield EchoTask(EchoData(prompt=f"Say {i}.", answer=str(i)))
'''

PROMPTS, GROUP_SIZE = 8, 4


def _pipeline_config(run_dir: Path, runner: dict) -> dict:
    return {
        "run": {"dir": str(run_dir), "max_steps": 100},
        "envs": [{"name": "verifiers", "args": {"taskset": "vf_echo:Echo"}, "group_size": GROUP_SIZE}],
        "batch": {"rollouts_per_step": 2 * GROUP_SIZE},
        # A group's rollouts share their row's reward: zero advantage, trained anyway so every step is full.
        "filters": {"zero_advantage": {"mode": "monitor"}},
        "inference": {"max_tokens": 8, "max_inflight": 16},
        "runner": runner,
    }


def put_echo_taskset_on_path(directory: Path, monkeypatch) -> Path:
    """The taskset as a module `vf_echo` in `directory`, importable here (the pipeline's submitter, Prism's
    LOOPBACK worker) and, through PYTHONPATH, in every process started from here from now on (a Flink
    cluster's worker pools)."""
    module_dir = directory / "taskset"
    module_dir.mkdir()
    (module_dir / "vf_echo.py").write_text(f"PROMPTS = {PROMPTS}\n" + textwrap.dedent(PIPELINE_TASKSET))
    monkeypatch.syspath_prepend(str(module_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(module_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return module_dir


@pytest.fixture
def echo_taskset(tmp_path: Path, monkeypatch) -> Path:
    return put_echo_taskset_on_path(tmp_path, monkeypatch)


def _servers():
    from beam_rl.standin.server import EmbeddedServer

    started = [EmbeddedServer(mode="instant", served_model_name="tiny", max_num_seqs=64) for _ in range(2)]
    return started, [s.start() for s in started]


def _assert_scored_by_the_taskset(run_dir: Path) -> set[str]:
    """Every row's group was scored once, with the reward the taskset's functions give it; returns the
    scoring workers (host:pid)."""
    from beam_rl.rundir import RunDir

    rd = RunDir(run_dir)
    steps = rd.committed_steps()
    assert steps == list(range(1, len(steps) + 1))
    rewards: dict[int, list[float]] = collections.defaultdict(list)
    workers: set[str] = set()
    for step in steps:
        window = rd.read_window(step).to_pydict()
        assert set(window["status"]) == {"ok"}, window["errors"]
        for index, reward in zip(window["index"], window["reward"]):
            rewards[index].append(reward)
        workers.update(window["score_worker"])
    assert dict(rewards) == {i: [float(i)] * GROUP_SIZE for i in range(PROMPTS)}
    return workers


def test_prism_workers_score_with_a_verifiers_taskset(echo_taskset, tmp_path):
    from beam_rl.config import config_from_dict
    from beam_rl.job.rollouts import run_rollouts

    started, urls = _servers()
    try:
        run_rollouts(config_from_dict(_pipeline_config(tmp_path / "run", {"name": "direct"})), urls, with_trainer=False)
    finally:
        for s in started:
            s.stop()
    assert "verifiers.v1" in sys.modules  # LOOPBACK: Prism's worker is this process
    _assert_scored_by_the_taskset(tmp_path / "run")
