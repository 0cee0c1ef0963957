"""A verifiers v1 taskset over the side-by-side harness's prompts file (bench/peers/job.py `prompts_path`):
one task per line, its "prompt" text the user turn. The reward is the reply's length (capped): the harness
measures the rollout loop, not the score, so it costs nothing, yet it varies within a group, as a trainer
needs (prime-rl's GRPO drops a group whose rewards are all equal, and stops after 10 empty batches).

Its id is its module name, `vf_peer_prompts` (bench/peers/shims on PYTHONPATH).
"""

import json
from pathlib import Path

import verifiers.v1 as vf


class PromptData(vf.TaskData):
    group_id: str


class PromptTask(vf.Task[PromptData]):
    @vf.reward
    async def length(self, trace: vf.Trace) -> float:
        return min(1.0, len(trace.last_reply) / 256)


class PromptsConfig(vf.TasksetConfig):
    prompts_path: str = ""


class Prompts(vf.Taskset[PromptTask, PromptsConfig]):
    def load(self):
        with Path(self.config.prompts_path).open() as lines:
            for line in lines:
                row = json.loads(line)
                yield PromptTask(PromptData(prompt=row["prompt"], group_id=row["group_id"]), self.config.task)


__all__ = ["Prompts"]
