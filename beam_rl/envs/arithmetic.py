"""Verifiable arithmetic: "What is 12 + 7?" is right when the first integer of the answer is 19.

`arithmetic_easy` is the learnable config: one-digit answers plus partial credit, so a tiny
random-init model sees reward variance inside a group from its first step.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from beam_rl.envs.base import DatasetEnvironment, Trajectory, chat_prompt_ids
from beam_rl.envs.datasets import BadRows, PromptText
from beam_rl.envs.registry import register_env

# ASCII digits only, with an optional minus sign glued to them: "-3" is -3, "5-3" starts with 5,
# "7.5" starts with 7. Unicode digits (str.isdigit) are not answers to an ASCII question.
_INTEGER = re.compile(r"-?[0-9]+")


def first_integer(text: str) -> int | None:
    """The first integer written in `text`, or None if it has no digits."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


class ArithmeticRow(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    question: PromptText
    answer: str
    level: int = Field(0, ge=0)  # 0 = one-digit answer, 1 = one-digit operands, 2 = two-digit operands

    @field_validator("answer")
    @classmethod
    def _integer_answer(cls, answer: str) -> str:
        if not re.fullmatch(r"-?[0-9]+", answer):
            raise ValueError(f"answer must be an integer written in ASCII digits, got {answer!r}")
        return answer


def spend_cpu(seconds: float) -> None:
    """Busy this thread for `seconds` of its own CPU time (not wall time: a busy machine stretches it)."""
    until, x = time.thread_time() + seconds, 0
    while time.thread_time() < until:
        for _ in range(1000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


@register_env
class Arithmetic(DatasetEnvironment):
    """Single-turn arithmetic with an exact, verifiable reward.

    reward = 1.0 if first_integer(completion) == answer
             partial_credit if the completion holds some other integer
             0.0 if it holds no integer at all.
    `max_level` keeps only rows up to that difficulty level (None = all). `reward_cpu_ms` makes each reward
    also spend that much CPU time, as a judge model or a test suite would: a load to measure how the
    scoring stage spreads over workers.
    """

    name = "arithmetic"
    row_model = ArithmeticRow
    data_dir = Path(__file__).resolve().parent / "data"
    data_name = "arithmetic"
    PROMPT = "What is {question}? Reply with just the number."

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        partial_credit: float = 0.0,
        max_level: int | None = None,
        reward_cpu_ms: float = 0.0,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
        max_context: int | None = None,
    ) -> None:
        super().__init__(tokenizer, max_turns, dataset=dataset, bad_rows=bad_rows, max_context=max_context)
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
        if reward_cpu_ms < 0:
            raise ValueError(f"reward_cpu_ms must be >= 0, got {reward_cpu_ms}")
        self.partial_credit = partial_credit
        self.max_level = max_level
        self.reward_cpu_ms = reward_cpu_ms

    def select_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.max_level is None:
            return rows
        return [row for row in rows if row["level"] <= self.max_level]

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        content = self.PROMPT.format(question=row["question"])
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": content}])

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        if self.reward_cpu_ms:
            spend_cpu(self.reward_cpu_ms / 1000)
        predicted = first_integer(self.final_text(trajectory))
        if predicted is None:
            return 0.0
        return 1.0 if predicted == int(row["answer"]) else self.partial_credit


@register_env
class ArithmeticEasy(Arithmetic):
    """The learnable config: level-0 rows (one-digit answers) and 0.1 for writing any integer.

    A random-init model already writes a digit somewhere in most 24-token completions, so most
    groups of 8 differ in reward from step one; once every completion holds a digit, a random one
    is right one time in ten, so the mean reward climbs from about 0.09 towards 0.19 as the model
    learns the answer format (measured with the tiny 2-layer Qwen2, plain GRPO, 64 rollouts a step,
    lr 1e-3: 0.09 -> 0.18 in 30 steps). Going beyond that takes actually learning the sums.
    """

    name = "arithmetic_easy"

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        partial_credit: float = 0.1,
        max_level: int | None = 0,
        reward_cpu_ms: float = 0.0,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
        max_context: int | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            max_turns,
            partial_credit=partial_credit,
            max_level=max_level,
            reward_cpu_ms=reward_cpu_ms,
            dataset=dataset,
            bad_rows=bad_rows,
            max_context=max_context,
        )
