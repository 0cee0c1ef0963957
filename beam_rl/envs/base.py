"""What an environment is: a dataset, a prompt renderer, a turn loop, and a reward.

Generation and scoring are separate stages. The dispatcher calls `run` (one trajectory) or `run_group`
(all of a group's trajectories in one request, sharing the prompt's prefill) and turns the returned
`Trajectory` objects into `Rollout`s; the scoring stage, possibly in another worker process, later calls
`reward(row, trajectory)` on an environment built from the same config.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from beam_rl.envs.datasets import BadRows, DatasetError, RowProblem, prompt_fields, read_dataset
from beam_rl.inference.types import Completion, CompletionClient, SamplingParams
from beam_rl.types import Turn

__all__ = [
    "Completion",
    "CompletionClient",
    "DatasetEnvironment",
    "Environment",
    "RewardUnavailable",
    "SamplingParams",
    "Trajectory",
    "chat_prompt_ids",
    "finite_reward",
]


@dataclass
class Trajectory:
    """What generation produced: the model's turns, plus `info`, the JSON-able facts the environment's
    turn loop learned that its reward needs (it travels with the rollout to the scoring stage).

    `prompt_ids`, when set, is the context of the first turn in place of the rendered prompt the episode was
    given: a program that writes its own first prompt (a black-box agent behind the proxy) sets it."""

    turns: list[Turn] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None


class RewardUnavailable(Exception):
    """The reward could not be computed for a reason outside the policy's control (a sandbox or judge
    that failed, timed out or answered nonsense): the rollout is left out of its group's advantages
    rather than scored 0."""


def finite_reward(value: Any) -> float | None:
    """`value` as the float a reward is, or None when it is none: not a real number (a bool is a verdict, not
    a score: True would train as 1.0), or not finite once a float (NaN, inf, an int or Fraction past 1.8e308,
    whose conversion overflows)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        reward = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return reward if math.isfinite(reward) else None


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` (and the `tools` the model may call) rendered with the tokenizer's chat
    template, by default ready for the assistant.

    transformers 5 returns a BatchEncoding by default; the dispatcher needs a plain list of ints.
    Control-token text inside messages (a dataset row or a tool's output containing "<|im_end|>") is
    encoded as plain text, so data can never forge a turn boundary.
    """
    encoded = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        sanitize_control_tokens=True,
    )
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(token_id) for token_id in encoded]


class Environment(abc.ABC):
    """Base class of every environment; subclasses register themselves in beam_rl.envs."""

    name: str = ""
    multi_turn: bool = False

    def __init__(self, tokenizer: Any, max_turns: int = 4) -> None:
        self.tokenizer = tokenizer
        self.max_turns = max_turns

    @abc.abstractmethod
    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        """The dataset rows for a split ("train" or "eval")."""

    @abc.abstractmethod
    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        """The prompt's token ids, rendered with the tokenizer's chat template."""

    @abc.abstractmethod
    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float | Awaitable[float]:
        """Score one trajectory (a plain or an `async` method). Raise RewardUnavailable when the score
        cannot be known for reasons that are not the policy's fault."""

    def stop_token_ids(self) -> list[int]:
        """Generation stops at the end of the assistant's message (the tokenizer's eos)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if eos is not None else []

    def final_text(self, trajectory: Trajectory) -> str:
        """The text of the last turn's completion up to its first EOS: a single-turn answer."""
        return self.decode(trajectory.turns[-1].completion_ids) if trajectory.turns else ""

    def decode(self, token_ids: list[int]) -> str:
        """The completion's text up to its first EOS: what a model writes after EOS is not its answer."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and eos in token_ids:
            token_ids = token_ids[: token_ids.index(eos)]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        """One trajectory. Single-turn default: one completion, scored by `reward`."""
        (completion,) = await client.complete(prompt_ids, sampling, n=1)
        return self._single_turn(row, completion)

    def group_is_one_call(self) -> bool:
        """Whether `run_group` makes one completion call of n choices and nothing after it, so that a choice
        the server finishes is a finished rollout: the dispatcher then gives its permit back as it ends,
        not when the group's longest one does. An environment that overrides `run_group` is not, unless it
        says so by overriding this too."""
        return getattr(type(self).run_group, "one_call", False) and not self.multi_turn

    async def run_group(
        self,
        client: CompletionClient,
        row: dict[str, Any],
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
    ) -> list[Trajectory]:
        """All `n` trajectories of a group in one request (`n` choices share one prefill)."""
        if self.multi_turn:
            raise NotImplementedError(f"{self.name} is multi-turn: run it one rollout per call")
        completions = await client.complete(prompt_ids, sampling, n=n)
        return [self._single_turn(row, c) for c in completions]

    run_group.one_call = True  # type: ignore[attr-defined]

    def _single_turn(self, row: dict[str, Any], completion: Completion) -> Trajectory:
        return Trajectory(
            [
                Turn(
                    completion.token_ids,
                    completion.logprobs,
                    completion.finish_reason,
                    policy_versions=completion.policy_versions,
                )
            ]
        )


class DatasetEnvironment(Environment):
    """An environment whose rows come from a dataset validated by `row_model`.

    `dataset=None` reads the bundled `<data_dir>/<data_name>_<split>.jsonl`; otherwise `dataset` is a
    directory of splits (see beam_rl.envs.datasets.read_dataset). `bad_rows="skip"` drops malformed rows
    instead of failing; the ones dropped per split are kept in `skipped_rows` for metrics.

    With `max_context` (model.max_context), a row whose rendered prompt leaves no room to generate is
    a bad row like a malformed one (named by file and line, failed or skipped), and a single-turn
    request's max_tokens is cut to the room its prompt leaves, so no request exceeds the context.
    """

    row_model: type[BaseModel]
    data_dir: Path
    data_name: str = ""

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
        max_context: int | None = None,
    ) -> None:
        super().__init__(tokenizer, max_turns)
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.dataset = dataset
        self.bad_rows = bad_rows
        self.max_context = max_context
        self.skipped_rows: dict[str, list[DatasetError]] = {}

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        check = self._prompt_fits if self.max_context is not None else None
        if self.dataset is None:
            bundled = self.data_dir / f"{self.data_name}_{split}.jsonl"
            loaded = read_dataset(bundled, self.row_model, bad_rows=self.bad_rows, check=check)
        else:
            loaded = read_dataset(self.dataset, self.row_model, split=split, bad_rows=self.bad_rows, check=check)
        self.skipped_rows[split] = loaded.skipped
        return self.select_rows(loaded.rows)

    def _prompt_fits(self, row: dict[str, Any]) -> RowProblem | None:
        assert self.max_context is not None
        length = len(self.render_prompt(row))
        if length < self.max_context:
            return None
        fields = prompt_fields(self.row_model)
        return RowProblem(
            f"prompt renders to {length} tokens, leaving no room to generate under model.max_context "
            f"({self.max_context})",
            field=fields[0] if len(fields) == 1 else None,
        )

    def _fit_sampling(self, prompt_ids: list[int], sampling: SamplingParams) -> SamplingParams:
        # A prompt that fits but leaves less than max_tokens gets a shorter budget, not a 400 from vLLM.
        if self.max_context is None or len(prompt_ids) + sampling.max_tokens <= self.max_context:
            return sampling
        return dataclasses.replace(sampling, max_tokens=max(1, self.max_context - len(prompt_ids)))

    def turn_sampling(self, sampling: SamplingParams, turn: int, context_len: int) -> SamplingParams | None:
        """A multi-turn episode's sampling for `turn` (from 1) after `context_len` tokens of context: its
        budget cut to the room left under max_context, its seed offset per turn (the same seed every turn
        would replay the same random stream). None when no room is left; an error if the prompt alone
        fills the context."""
        room = sampling.max_tokens if self.max_context is None else self.max_context - context_len
        if room < 1:
            if turn == 1:
                raise ValueError(f"prompt of {context_len} tokens leaves no room under max_context={self.max_context}")
            return None
        return dataclasses.replace(
            sampling,
            max_tokens=min(sampling.max_tokens, room),
            seed=None if sampling.seed is None else sampling.seed + turn - 1,
        )

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        return await super().run(client, row, prompt_ids, self._fit_sampling(prompt_ids, sampling))

    async def run_group(
        self,
        client: CompletionClient,
        row: dict[str, Any],
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
    ) -> list[Trajectory]:
        return await super().run_group(client, row, prompt_ids, self._fit_sampling(prompt_ids, sampling), n)

    run_group.one_call = True  # type: ignore[attr-defined]

    def select_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Hook for a subset of the validated rows (a curriculum level); all of them by default."""
        return rows
