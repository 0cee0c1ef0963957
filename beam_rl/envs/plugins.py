"""Environments from outside beam-rl: loading a plug-in class by entry point or import path, checking it
before the run starts, and guarding its calls during the run so a broken plug-in is named, not guessed at.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import numbers
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from beam_rl.envs.base import (
    CompletionClient,
    Environment,
    RewardUnavailable,
    SamplingParams,
    Trajectory,
    finite_reward,
)
from beam_rl.inference.client import InferenceError
from beam_rl.types import Turn

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "beam_rl.environments"


class PluginError(Exception):
    """An environment class that cannot be used: it does not import, is not an Environment, leaves
    methods abstract, or its name is ambiguous. Raised before the run starts."""


class PluginFailure(RuntimeError):
    """A plug-in broke the environment protocol during the run: one of its methods raised, or returned
    something of the wrong type. The message names the env entry, the plug-in and the row."""


def is_import_path(kind: str) -> bool:
    return ":" in kind


def entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """The `beam_rl.environments` entry points of every installed distribution, by name."""
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        # The same distribution seen twice on sys.path (an editable install plus a copy) is one plug-in.
        if all(other.value != ep.value for other in found.get(ep.name, [])):
            found.setdefault(ep.name, []).append(ep)
    return found


def load_plugin_class(kind: str) -> type[Environment] | None:
    """The class a plug-in `kind` names ("module:Class" or an entry-point name), checked; None when
    `kind` is neither an import path nor an installed entry point."""
    if is_import_path(kind):
        return check_env_class(_import_attr(kind, kind), kind)
    candidates = entry_points().get(kind, [])
    if not candidates:
        return None
    if len(candidates) > 1:
        sources = ", ".join(f"{ep.value} ({_dist_name(ep)})" for ep in candidates)
        raise PluginError(
            f"kind {kind!r}: several {ENTRY_POINT_GROUP} entry points have this name: {sources}; "
            "name the class as 'module:Class' instead"
        )
    ep = candidates[0]
    return check_env_class(_import_attr(ep.value, f"{kind} (entry point {ep.value} of {_dist_name(ep)})"), kind)


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"distribution {dist.name}" if dist is not None else "an unknown distribution"


def _import_attr(path: str, what: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PluginError(f"kind {what!r}: an import path is 'package.module:Class', got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginError(
            f"kind {what!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            f"{_at(plugin_location(exc, module_name))}"
        ) from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginError(f"kind {what!r}: module {module_name!r} has no attribute {attr!r}") from None
    return target


def check_env_class(cls: Any, kind: str) -> type[Environment]:
    """`cls` if it is a usable Environment class: concrete, with the protocol's methods sync or async as
    the dispatcher and the scoring stage call them."""
    if not isinstance(cls, type):
        raise PluginError(f"kind {kind!r} names {cls!r}, which is not a class")
    if not issubclass(cls, Environment):
        raise PluginError(f"kind {kind!r}: {_qualname(cls)} is not a subclass of beam_rl.envs.base.Environment")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"kind {kind!r}: {_qualname(cls)} does not implement {missing}")
    for method in ("run", "run_group"):
        if not inspect.iscoroutinefunction(getattr(cls, method)):
            raise PluginError(f"kind {kind!r}: {_qualname(cls)}.{method} must be `async def`")
    for method in ("load_rows", "render_prompt"):
        if inspect.iscoroutinefunction(getattr(cls, method)):
            raise PluginError(f"kind {kind!r}: {_qualname(cls)}.{method} must be a plain method, not `async def`")
    return cls


def construction_failed(kind: str, cls: type, exc: Exception) -> PluginError:
    return PluginError(
        f"kind {kind!r}: constructing {_qualname(cls)} raised {type(exc).__name__}: {exc}"
        f"{_at(plugin_location(exc, cls.__module__))}"
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def plugin_location(exc: BaseException, module_name: str) -> str | None:
    """Where in the plug-in's own code `exc` was raised: the innermost traceback frame in the plug-in's
    top-level package or module (else the innermost frame that is not Python's import machinery)."""
    if isinstance(exc, SyntaxError) and exc.filename:  # the frame that matters is not in the traceback
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    if not frames:
        return None
    owned = _owns(module_name)
    frame = ([f for f in frames if owned(f.filename)] or frames)[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _owns(module_name: str) -> Callable[[str], bool]:
    """Whether a file belongs to the plug-in: under its top-level package's directories, or its one file.
    Found from the import spec, so it works for a module whose import just failed."""
    try:
        spec = importlib.util.find_spec(module_name.split(".", 1)[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return lambda filename: False
    if spec.submodule_search_locations:
        roots = [Path(p).resolve() for p in spec.submodule_search_locations]
        return lambda filename: any(_resolved(filename).is_relative_to(root) for root in roots)
    origin = Path(spec.origin).resolve() if spec.origin else None
    return lambda filename: _resolved(filename) == origin


def _resolved(filename: str) -> Path:
    try:
        return Path(filename).resolve()
    except OSError:
        return Path(filename)


def _at(location: str | None) -> str:
    return f" (at {location})" if location else ""


def short_repr(value: Any, limit: int = 120) -> str:
    """`repr(value)` cut to `limit` characters, for an error's one line; what cannot be printed (an int of
    more than 4,300 digits) is named by its type."""
    try:
        text = repr(value)
    except Exception:  # a plug-in's own __repr__ may raise anything
        return f"<{type(value).__name__} that cannot be printed>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PluginEnvironment(Environment):
    """A plug-in environment behind checks: every call the pipeline makes is checked where it happens
    (types of what comes back; exceptions re-raised as PluginFailure naming the env entry, the plug-in,
    the row and the plug-in's own traceback location). Attributes not defined here are the plug-in's.
    """

    def __init__(self, env: Environment, env_name: str, kind: str) -> None:
        # Environment.__init__ is not called: tokenizer and max_turns are the plug-in's own.
        self.inner = env
        self.name = env_name
        self.kind = kind
        self._module = type(env).__module__
        self._logged: set[str] = set()

    def __getattr__(self, attr: str) -> Any:  # only called for attributes not found on the guard
        inner = self.__dict__.get("inner")
        if inner is None:  # mid-construction (or unpickling): nothing to delegate to yet
            raise AttributeError(attr)
        return getattr(inner, attr)

    @property
    def multi_turn(self) -> bool:  # type: ignore[override]
        return self.inner.multi_turn

    def group_is_one_call(self) -> bool:
        return self.inner.group_is_one_call()

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def max_turns(self) -> int:  # type: ignore[override]
        return self.inner.max_turns

    def _who(self) -> str:
        return f"env {self.name!r} (plug-in {self.kind!r})"

    def _failure(self, method: str, exc: Exception, row: Any) -> PluginFailure:
        location = plugin_location(exc, self._module)
        if (location or "") not in self._logged:  # the full traceback once per place, not once per rollout
            self._logged.add(location or "")
            log.error("%s: %s raised", self._who(), method, exc_info=exc)
        return PluginFailure(
            f"{self._who()}: {method} raised {type(exc).__name__}: {exc}{_at(location)}; row {short_repr(row)}"
        )

    def _wrong(self, method: str, problem: str, row: Any) -> PluginFailure:
        return PluginFailure(f"{self._who()}: {method} {problem}; row {short_repr(row)}")

    # -- the protocol -------------------------------------------------------------------------------

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        rows = self.inner.load_rows(split)  # dataset errors keep their own type and message
        if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
            raise PluginFailure(f"{self._who()}: load_rows({split!r}) returned {short_repr(rows)}, not a list of dicts")
        return [dict(r) for r in rows]

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        try:
            ids = self.inner.render_prompt(row)
        except Exception as exc:
            raise self._failure("render_prompt", exc, row) from exc
        if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t) for t in ids):
            hint = (
                (
                    " (transformers 5's apply_chat_template returns a BatchEncoding: "
                    "beam_rl.envs.base.chat_prompt_ids gives the list)"
                )
                if isinstance(ids, Mapping)
                else ""
            )
            raise self._wrong("render_prompt", f"returned {short_repr(ids)}, not a list of token ids{hint}", row)
        return [int(t) for t in ids]

    def stop_token_ids(self) -> list[int]:
        return self.inner.stop_token_ids()

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        try:
            trajectory = await self.inner.run(client, row, prompt_ids, sampling)
        except InferenceError:
            raise  # the server's fault, not the plug-in's: the dispatcher counts it against the server
        except Exception as exc:
            raise self._failure("run", exc, row) from exc
        return self._checked_trajectory("run", trajectory, row)

    async def run_group(
        self,
        client: CompletionClient,
        row: dict[str, Any],
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
    ) -> list[Trajectory]:
        try:
            trajectories = await self.inner.run_group(client, row, prompt_ids, sampling, n)
        except (InferenceError, NotImplementedError):
            raise
        except Exception as exc:
            raise self._failure("run_group", exc, row) from exc
        if not isinstance(trajectories, (list, tuple)):
            raise self._wrong("run_group", f"returned {short_repr(trajectories)}, not a list of Trajectory", row)
        return [self._checked_trajectory("run_group", t, row) for t in trajectories]

    def _checked_trajectory(self, method: str, trajectory: Any, row: Any) -> Trajectory:
        if not isinstance(trajectory, Trajectory):
            raise self._wrong(method, f"returned {short_repr(trajectory)}, not a beam_rl.envs.base.Trajectory", row)
        for i, turn in enumerate(trajectory.turns):
            if not isinstance(turn, Turn):
                raise self._wrong(
                    method, f"returned a trajectory whose turn {i} is {short_repr(turn)}, not a Turn", row
                )
            for field in ("completion_ids", "env_ids"):
                ids = getattr(turn, field)
                if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
                    raise self._wrong(
                        method, f"returned turn {i} with {field} {short_repr(ids)}, not a list of ints", row
                    )
            if not isinstance(turn.logprobs, list) or len(turn.logprobs) != len(turn.completion_ids):
                raise self._wrong(
                    method,
                    f"returned turn {i} with {short_repr(turn.logprobs)} as logprobs for "
                    f"{len(turn.completion_ids)} completion ids",
                    row,
                )
        if not isinstance(trajectory.info, dict):
            raise self._wrong(method, f"returned info {short_repr(trajectory.info)}, not a dict", row)
        try:  # info travels to the scoring stage (another process on a cluster) and into the run record
            json.dumps(trajectory.info)
        except (TypeError, ValueError) as exc:
            raise self._wrong(method, f"returned info that is not JSON-able ({exc})", row) from None
        return trajectory

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float | Awaitable[float]:
        try:
            value = self.inner.reward(row, trajectory)
        except RewardUnavailable:
            raise
        except Exception as exc:
            raise self._failure("reward", exc, row) from exc
        if inspect.isawaitable(value):
            return self._awaited_reward(value, row)
        return self._checked_reward(value, row)

    async def _awaited_reward(self, pending: Awaitable[Any], row: Any) -> float:
        try:
            value = await pending
        except RewardUnavailable:
            raise
        except Exception as exc:
            raise self._failure("reward", exc, row) from exc
        return self._checked_reward(value, row)

    def _checked_reward(self, value: Any, row: Any) -> float:
        reward = finite_reward(value)
        if reward is None:
            raise self._wrong(
                "reward", f"returned {short_repr(value)} ({type(value).__name__}), not a finite number", row
            )
        return reward


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
