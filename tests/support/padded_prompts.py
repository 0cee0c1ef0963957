"""A plug-in environment for the tests of a run that cannot train: reverse_text's rows and reward, each
prompt led by `pad_tokens` filler tokens, and no fitting of its own to model.max_context (as an ecosystem
environment whose default harness makes prompts longer than the model's context)."""

from __future__ import annotations

from typing import Any

from beam_rl.envs.base import Environment, Trajectory
from beam_rl.envs.reverse_text import ReverseText


class PaddedPrompts(Environment):
    name = "padded_prompts"

    def __init__(self, tokenizer: Any, max_turns: int = 1, pad_tokens: int = 0) -> None:
        super().__init__(tokenizer, max_turns)
        self._inner = ReverseText(tokenizer)
        self._pad = tokenizer.encode(" pad", add_special_tokens=False)[:1] * pad_tokens

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return self._inner.load_rows(split)

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return self._pad + self._inner.render_prompt(row)

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        return self._inner.reward(row, trajectory)
