"""An LLM judge as a reward: any OpenAI-compatible chat endpoint grades a completion, and a verdict rule
turns its answer into a number. A judge that fails, times out or answers nonsense makes the reward
unavailable (a reward_error), never a 0."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from typing import Any

import aiohttp

from beam_rl.config import JudgeSection
from beam_rl.envs.base import RewardUnavailable

# Retried: the judge may answer next time. 401/403/404 (a wrong key, model or URL) would fail every
# rollout of the run alike, so they stop it; any other 4xx is this request's problem alone.
_RETRIED_STATUSES = frozenset({408, 429})
_FATAL_STATUSES = frozenset({401, 403, 404})
_QUOTE_CHARS = 200


class JudgeError(RuntimeError):
    """A judge that cannot work for any rollout (refused with 401/403/404, no API key, a prompt field the
    row lacks): the run stops, naming the env and what to fix."""


def excerpt(text: str, limit: int = _QUOTE_CHARS) -> str:
    """`text` quoted, cut to `limit` characters: what error messages show of a judge's answer."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class Judge:
    """Grades `(row, completion text)` with one chat completion request per rollout.

    The request's messages are the optional system message and the prompt template filled with the
    row's fields and `completion`. The API key (from the environment variable `api_key_env` names) is
    read once, sent as `Authorization: Bearer`, and appears in no message, log or repr.
    """

    def __init__(self, config: JudgeSection, env_name: str) -> None:
        self.config = config
        self.env_name = env_name
        self.endpoint = f"{config.url}/v1/chat/completions"
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise JudgeError(
                    f"env {env_name!r}: reward.judge.api_key_env names {config.api_key_env}, "
                    "which is not set (or empty) in this process's environment"
                )
            self._headers["Authorization"] = f"Bearer {key}"
        self._pattern = re.compile(config.verdict.pattern)
        labels = config.verdict.labels
        self._labels = None if labels is None else {k.strip().lower(): float(v) for k, v in labels.items()}
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"Judge(env={self.env_name!r}, endpoint={self.endpoint!r}, model={self.config.model!r})"

    def messages(self, row: dict[str, Any], completion: str) -> list[dict[str, str]]:
        try:
            content = self.config.prompt.format_map({**row, "completion": completion})
        except KeyError as err:
            raise JudgeError(
                f"env {self.env_name!r}: reward.judge.prompt names {{{err.args[0]}}}, which the row "
                f"lacks (its fields: {sorted(row)})"
            ) from None
        system = [{"role": "system", "content": self.config.system}] if self.config.system else []
        return [*system, {"role": "user", "content": content}]

    def verdict(self, answer: str) -> float:
        """The reward the judge's answer gives; RewardUnavailable (quoting the answer) when it gives none."""
        matches = list(self._pattern.finditer(answer))
        if not matches:
            raise RewardUnavailable(
                f"judge answer has no verdict matching {self._pattern.pattern!r}: {excerpt(answer)}"
            )
        found = matches[-1].group(1) or ""  # the last one: a judge reasons first, then concludes
        if self._labels is not None:
            score = self._labels.get(found.strip().lower())
            if score is None:
                raise RewardUnavailable(
                    f"judge verdict {excerpt(found)} is none of the labels {sorted(self._labels)}: {excerpt(answer)}"
                )
            return score
        try:
            score = float(found)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise RewardUnavailable(f"judge verdict {excerpt(found)} is not a finite number: {excerpt(answer)}")
        return score

    async def grade(self, row: dict[str, Any], completion: str) -> float:
        """The judge's reward for `completion`; retries connection errors, 408, 429 and 5xx."""
        payload = {
            "model": self.config.model,
            "messages": self.messages(row, completion),
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            try:
                status, body = await self._post(payload)
            except TimeoutError:  # aiohttp's total timeout (TimeoutError itself from Python 3.11)
                raise RewardUnavailable(f"judge {self.endpoint} timed out after {self.config.timeout_s} s") from None
            except aiohttp.ClientError as err:
                failure = f"{type(err).__name__}: {err}"
                continue
            if status == 200:
                return self.verdict(answer_text(body))
            failure = f"HTTP {status}: {excerpt(_error_text(body))}"
            if status in _FATAL_STATUSES:
                raise JudgeError(
                    f"env {self.env_name!r}: judge {self.endpoint} refused the request ({failure}); "
                    "check reward.judge.url, model and api_key_env"
                )
            if status not in _RETRIED_STATUSES and status < 500:
                raise RewardUnavailable(f"judge {self.endpoint} answered {failure}")
        raise RewardUnavailable(f"judge {self.endpoint} failed {attempts} time(s), last: {failure}")

    async def _post(self, payload: dict[str, Any]) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with self._session().post(self.endpoint, json=payload, headers=self._headers, timeout=timeout) as resp:
            text = await resp.text(errors="replace")
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text

    def _session(self) -> aiohttp.ClientSession:
        # A session belongs to the event loop it was made on.
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = self._sessions[loop] = aiohttp.ClientSession()
        return session

    async def aclose(self) -> None:
        """Close the session of the running loop (call it on each loop the judge was used on)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


def answer_text(body: Any) -> str:
    """The text of a chat completion body's first choice; RewardUnavailable when it has none."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RewardUnavailable(f"judge answered without a chat message: {excerpt(str(body))}") from None
    if not isinstance(content, str):
        raise RewardUnavailable(f"judge answered with no text (content {excerpt(repr(content))})")
    return content


def _error_text(body: Any) -> str:
    """The message of an error body: OpenAI's {"error": {"message": ...}}, vLLM's {"error": "..."}, or the text."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error if isinstance(error, str) else body)
