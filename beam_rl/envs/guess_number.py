"""Guess the secret number: a multi-turn game whose environment answers "higher" / "lower" in ChatML.

The conversation is carried as exact token ids: each turn's context is the previous context plus
the model's completion ids plus the environment's hint ids; generated text is never re-tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from beam_rl.envs.arithmetic import first_integer
from beam_rl.envs.base import CompletionClient, DatasetEnvironment, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.datasets import BadRows
from beam_rl.envs.multi_turn import Conversation
from beam_rl.envs.registry import register_env
from beam_rl.model.tokenizer import IM_END, IM_START

HIGHER, LOWER, CORRECT = "higher", "lower", "correct"
NO_GUESS = "reply with a number"


class GuessNumberRow(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    # Declared low, high, secret so each validator sees the fields it is checked against.
    low: int
    high: int
    secret: int

    @field_validator("high")
    @classmethod
    def _range_not_empty(cls, high: int, info: ValidationInfo) -> int:
        low = info.data.get("low")
        if low is not None and high < low:
            raise ValueError(f"high ({high}) is below low ({low})")
        return high

    @field_validator("secret")
    @classmethod
    def _secret_in_range(cls, secret: int, info: ValidationInfo) -> int:
        low, high = info.data.get("low"), info.data.get("high")
        if low is not None and high is not None and not low <= secret <= high:
            raise ValueError(f"secret {secret} is outside [{low}, {high}]")
        return secret


def hint(guess: int | None, secret: int) -> str:
    """What the environment tells the player about a guess (None: the turn held no number)."""
    if guess is None:
        return NO_GUESS
    if guess == secret:
        return CORRECT
    return HIGHER if guess < secret else LOWER


@register_env
class GuessNumber(DatasetEnvironment):
    """Find `secret` in [low, high] within `max_turns` guesses, told "higher" or "lower" each time.

    Each turn's guess is the first integer of its text (up to EOS). The game ends on the correct
    guess, after `max_turns` turns, or when the next prompt would leave no room under `max_context`
    tokens (prompt, completions and hints together; None = unbounded); a turn's `max_tokens` is
    also cut to the room left, so a request never exceeds the server's context.
    reward = (max_turns - k + 1) / max_turns when the secret is found on turn k (1.0 on the first
    guess, 1/max_turns on the last), 0.0 when it is not found.
    """

    name = "guess_number"
    multi_turn = True
    row_model = GuessNumberRow
    data_dir = Path(__file__).resolve().parent / "data"
    data_name = "guess_number"
    PROMPT = "Guess my secret integer between {low} and {high}. Reply with one number."

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 5,
        *,
        max_context: int | None = None,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
    ) -> None:
        super().__init__(tokenizer, max_turns, dataset=dataset, bad_rows=bad_rows)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.max_context = max_context
        # Hints are ChatML turns built from token ids; a tokenizer that would split the markers
        # into ordinary pieces cannot continue a ChatML conversation faithfully.
        self._im_end_id = self._marker_id(IM_END)
        self._marker_id(IM_START)
        self._hint_cache: dict[tuple[str, bool], list[int]] = {}

    def _marker_id(self, marker: str) -> int:
        ids = self.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{self.name} needs a ChatML tokenizer: {marker!r} encodes to {ids}, not one token")
        return ids[0]

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        content = self.PROMPT.format(low=row["low"], high=row["high"])
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": content}])

    def game_reward(self, turn: int) -> float:
        """The reward for finding the secret on 1-based `turn`."""
        return (self.max_turns - turn + 1) / self.max_turns

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        """game_reward of the turn the secret was found on (the turn loop records it), else 0."""
        found = trajectory.info.get("found_on_turn")
        return self.game_reward(found) if found is not None else 0.0

    def hint_ids(self, hint_text: str, close_turn: bool) -> list[int]:
        """Token ids that answer the model and open its next turn.

        `close_turn` prepends <|im_end|> for a completion that did not end with one itself (it was
        cut by max_tokens); a completion that stopped on <|im_end|> already closed its turn.
        """
        key = (hint_text, close_turn)
        if key not in self._hint_cache:
            text = f"\n{IM_START}user\n{hint_text}{IM_END}\n{IM_START}assistant\n"
            self._hint_cache[key] = ([self._im_end_id] if close_turn else []) + self.tokenizer.encode(
                text, add_special_tokens=False
            )
        return list(self._hint_cache[key])

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        secret = row["secret"]
        conversation = Conversation(self, client, prompt_ids, sampling)
        while (completion_ids := await conversation.complete()) is not None:
            guess = first_integer(self.decode(completion_ids))
            if guess == secret:
                return Trajectory(conversation.turns, {"found_on_turn": conversation.turn})
            if conversation.last_turn:
                break
            closed = conversation.closed(self._im_end_id)
            conversation.reply(self.hint_ids(hint(guess, secret), close_turn=not closed))
        return Trajectory(conversation.turns)
