"""Reverse a short text: a dense reward (string similarity) that a tiny model can climb from zero."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from beam_rl.envs.base import DatasetEnvironment, Trajectory, chat_prompt_ids
from beam_rl.envs.datasets import PromptText
from beam_rl.envs.registry import register_env


class ReverseTextRow(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    text: PromptText


def similarity(predicted: str, target: str) -> float:
    """difflib's ratio 2*M/T in [0, 1]: M matched characters, T the two lengths summed."""
    return difflib.SequenceMatcher(None, predicted, target).ratio()


@register_env
class ReverseText(DatasetEnvironment):
    """Single-turn: reward = similarity(completion up to its first EOS, stripped, row["text"][::-1]).

    Every right character in the right order earns something, and so does stopping at the right
    length, so rewards differ within a group even for a random-init model (measured with the tiny
    2-layer Qwen2, plain GRPO, 64 rollouts a step: mean reward 0.10 -> 0.22 in 160 steps, most of it
    from learning to stop early).
    """

    name = "reverse_text"
    row_model = ReverseTextRow
    data_dir = Path(__file__).resolve().parent / "data"
    data_name = "reverse_text"
    PROMPT = "Reverse the text: {text}"

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        content = self.PROMPT.format(text=row["text"])
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": content}])

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        # Surrounding whitespace is formatting (a newline after the assistant header), not content.
        return similarity(self.final_text(trajectory).strip(), row["text"][::-1])
