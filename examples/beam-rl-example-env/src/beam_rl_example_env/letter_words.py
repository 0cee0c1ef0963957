"""`letter_words`: "Write 3 words that start with the letter 's'." A single-turn environment whose
reward is computed asynchronously in beam-rl's scoring stage, the way a remote grader would be."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from beam_rl.envs.base import DatasetEnvironment, Trajectory, chat_prompt_ids


class LetterWordsRow(BaseModel):
    model_config = ConfigDict(strict=True)

    letter: str = Field(pattern=r"^[a-z]$")
    count: int = Field(ge=1, le=10)


def score(text: str, letter: str, count: int) -> float:
    """The share of the `count` words asked for that the answer gives: words starting with `letter`
    (case-insensitive), each counted once, at most `count` of them."""
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
    return min(sum(w.startswith(letter) for w in words), count) / count


class LetterWords(DatasetEnvironment):
    """Rows {"letter": "s", "count": 3}; reward = score(answer, letter, count), in [0, 1]."""

    name = "letter_words"
    row_model = LetterWordsRow
    data_dir = Path(__file__).resolve().parent / "data"  # letter_words_train.jsonl, letter_words_eval.jsonl
    data_name = "letter_words"
    PROMPT = "Write {count} words that start with the letter '{letter}'."

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": self.PROMPT.format(**row)}])

    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        await asyncio.sleep(0)  # stands in for a call to a grader
        return score(self.final_text(trajectory), row["letter"], row["count"])
