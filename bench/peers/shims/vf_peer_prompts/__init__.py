"""A verifiers v1 taskset over the side-by-side harness's prompts file (bench/peers/job.py `prompts_path`):
one task per line, its "prompt" text the user turn. The reward is a constant: the harness measures the
rollout loop, not the score, and a reward that costs nothing keeps the env layer's own cost what is measured.

Its id is its module name, `vf_peer_prompts` (bench/peers/shims on PYTHONPATH).
"""

import json
from pathlib import Path

import verifiers.v1 as vf


class PromptData(vf.TaskData):
    group_id: str


class PromptTask(vf.Task[PromptData]):
    @vf.reward
    async def answered(self, trace: vf.Trace) -> float:
        return float(bool(trace.last_reply))


class PromptsConfig(vf.TasksetConfig):
    prompts_path: str = ""


class Prompts(vf.Taskset[PromptTask, PromptsConfig]):
    def load(self):
        with Path(self.config.prompts_path).open() as lines:
            for line in lines:
                row = json.loads(line)
                yield PromptTask(PromptData(prompt=row["prompt"], group_id=row["group_id"]), self.config.task)


__all__ = ["Prompts"]
