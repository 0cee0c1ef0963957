"""The token-exact turn loop of a multi-turn environment, for the bundled ones and plug-ins alike.

Each turn's context is the previous context + the previous completion's ids + the environment's reply
(`env_ids`); generated text is never re-tokenized. What a turn means (a guess, tool calls) and what the
environment answers stay with the environment; this class keeps the context, the turns, the per-turn
sampling and the turn and context bounds.
"""

from __future__ import annotations

from typing import Any

from beam_rl.envs.base import CompletionClient, DatasetEnvironment, SamplingParams, chat_prompt_ids
from beam_rl.types import Turn


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot carry a conversation token-exactly."""


class FollowUps:
    """Token ids of the messages that follow an assistant turn (tool results, a user's next message), cut
    from the chat template's own rendering of a conversation.

    The template renders [user, assistant] and [user, assistant, *messages] (with a generation prompt);
    the second must extend the first token for token, and the extension is what follows an assistant turn
    in the real conversation. The assistant's own tokens are never rendered into the context: they are
    the ids the server returned.
    """

    def __init__(self, tokenizer: Any, stop_id: int) -> None:
        self.tokenizer = tokenizer
        self.stop_id = stop_id
        self._base = chat_prompt_ids(tokenizer, _base_messages(), add_generation_prompt=False)
        if stop_id not in self._base:
            raise ChatTemplateError(f"the chat template does not end an assistant turn with token {stop_id}")
        # What the template writes between the assistant's stop token and the next message ("\n" in ChatML).
        self.separator = self._base[len(self._base) - self._base[::-1].index(stop_id) :]

    def ids(self, messages: list[dict[str, Any]], closed: bool) -> list[int]:
        """What follows a completion: its stop token if it was cut before writing one, `messages` and the
        opening of the assistant's next turn."""
        base = self._base
        full = chat_prompt_ids(self.tokenizer, [*_base_messages(), *messages])
        if full[: len(base)] != base:
            raise ChatTemplateError(
                "the chat template renders earlier messages differently once these messages follow: "
                "they cannot be appended token-exactly"
            )
        return ([] if closed else [self.stop_id]) + self.separator + full[len(base) :]


def _base_messages() -> list[dict[str, str]]:
    # Any user and assistant turn: only what the template writes after them is used.
    return [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]


class Conversation:
    """One episode of `env`: `await complete()` for the next turn, `reply(env_ids)` for the environment's
    answer, until the environment is done or `complete()` returns None.

        conversation = Conversation(self, client, prompt_ids, sampling)
        while (completion_ids := await conversation.complete()) is not None:
            if is_final(completion_ids) or conversation.last_turn:
                break
            conversation.reply(answer_ids(completion_ids, closed=conversation.closed(stop_id)))
        return Trajectory(conversation.turns)
    """

    def __init__(
        self, env: DatasetEnvironment, client: CompletionClient, prompt_ids: list[int], sampling: SamplingParams
    ) -> None:
        self.env = env
        self.client = client
        self.sampling = sampling
        self.context = list(prompt_ids)
        self.turns: list[Turn] = []
        self._env_ids: list[int] = []  # the reply before the coming turn; none before the first

    @property
    def turn(self) -> int:
        """The number (from 1) of the latest turn; 0 before the first."""
        return len(self.turns)

    @property
    def last_turn(self) -> bool:
        """The latest turn was the last of `env.max_turns`: a reply would never be read."""
        return self.turn >= self.env.max_turns

    def closed(self, stop_id: int) -> bool:
        """The latest completion ended its own turn with `stop_id`; one cut by max_tokens did not, and
        the reply must close it first."""
        completion_ids = self.turns[-1].completion_ids if self.turns else []
        return bool(completion_ids) and completion_ids[-1] == stop_id

    async def complete(self) -> list[int] | None:
        """The next turn's completion ids (the turn is recorded with the reply before it), or None when
        the episode is out of turns or the context has no room left (`env.turn_sampling`)."""
        turn = self.turn + 1
        if turn > self.env.max_turns:
            return None
        turn_sampling = self.env.turn_sampling(self.sampling, turn, len(self.context))
        if turn_sampling is None:
            return None
        # A copy: `context` keeps growing, and a client may hold on to the list it was given.
        (completion,) = await self.client.complete(list(self.context), turn_sampling, n=1)
        completion_ids = list(completion.token_ids)
        self.turns.append(Turn(completion_ids, list(completion.logprobs), completion.finish_reason, self._env_ids))
        self.context += completion_ids
        self._env_ids = []
        return completion_ids

    def reply(self, env_ids: list[int]) -> None:
        """The environment's tokens before the next turn (a hint, tool messages, the next turn's opening):
        context, never trained on. A reply that leaves no room ends the episode at the next `complete()`."""
        self._env_ids = list(env_ids)
        self.context += self._env_ids
