"""A verifiers (v1) taskset's own reward functions scoring beam-rl rollouts, through the `verifiers`
environment.

verifiers 0.4.0 and Apache Beam 2.62 need protobuf >= 6.31 and < 6, so pip cannot install both in one
environment and they cannot be imported in one process. The test installs nothing: it runs verifiers from
an install directory of its own (BEAM_RL_VERIFIERS_PATH, default ~/.cache/beam-rl/verifiers-0.4.0, made by
`pip install --target DIR verifiers==0.4.0`), in a subprocess that imports beam_rl but never Beam.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERIFIERS_PATH = Path(os.environ.get("BEAM_RL_VERIFIERS_PATH", Path.home() / ".cache/beam-rl/verifiers-0.4.0"))

pytestmark = [
    pytest.mark.skipif(not (VERIFIERS_PATH / "verifiers" / "v1").is_dir(),
                       reason=f"no verifiers install at {VERIFIERS_PATH} (pip install --target DIR verifiers==0.4.0)"),
    pytest.mark.timeout(300),
]

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
from beam_rl.rewards import assign_rewards
from beam_rl.tokenizer import load_tokenizer
from beam_rl.types import Rollout

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
out["beam_imported"] = "apache_beam" in sys.modules
print(json.dumps(out))
'''


def test_a_tasksets_own_rewards_score_beam_rl_rollouts(tmp_path: Path) -> None:
    (tmp_path / "sums.py").write_text(textwrap.dedent(TASKSET))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(VERIFIERS_PATH), str(REPO)])}
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
    assert out["beam_imported"] is False


def test_verifiers_cannot_be_imported_next_to_beams_protobuf(tmp_path: Path) -> None:
    """Why the test above runs verifiers in a process of its own: with the virtualenv's protobuf first on the
    path (the one Apache Beam 2.62 needs), verifiers.v1 does not import."""
    code = "import apache_beam, google.protobuf; print(google.protobuf.__version__); import verifiers.v1"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.append({str(VERIFIERS_PATH)!r}); {code}"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and proc.stdout.startswith("5.")
    assert "Detected incompatible Protobuf Gencode/Runtime versions" in proc.stderr
    assert "prime_sandboxes" in proc.stderr
