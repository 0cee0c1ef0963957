"""Fault injection of the embedded server: one pydantic model that the constructor takes, the
command line's `--fault-*` flags are derived from, and `GET/POST /faults` read and update.

Faults are for tests and benchmarks: a server injects them, and serves `/faults`, only when started with
them (a FaultConfig given to the constructor; `--enable-faults` or any `--fault-*` flag on the command line).
"""

from __future__ import annotations

import argparse
import itertools
import random
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from beam_rl.standin.generator import ChoiceResult, GenerationParams, Weights


class ScriptedReply(BaseModel):
    """One scripted answer: its text, and how long the server takes to give it."""

    model_config = ConfigDict(extra="forbid")

    text: str
    latency_s: float = Field(0.0, ge=0)


class FaultConfig(BaseModel):
    """Test-only faults; each rate is a per-request probability, drawn from a seeded RNG."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(
        0.0, ge=0, description="seconds added to every request (model and instant: while it holds its running slots)"
    )
    step_delay_s: float = Field(
        0.0,
        ge=0,
        description="seconds added to every decode step (a slow engine); instant mode then makes one token per step",
    )
    error_rate: float = Field(0.0, ge=0, le=1, description="answer HTTP 500")
    hang_rate: float = Field(0.0, ge=0, le=1, description="never answer; ends when the client disconnects")
    empty_rate: float = Field(0.0, ge=0, le=1, description="answer HTTP 200 with zero completion tokens")
    drop_rate: float = Field(0.0, ge=0, le=1, description="close the connection without a response")
    die_after_tokens: int | None = Field(
        None,
        ge=1,
        description="die once this many more tokens are generated: a subprocess server exits, an "
        "in-process one closes every connection and its port",
    )
    replies: list[ScriptedReply] = Field(
        default_factory=list, description="answer every choice with these texts in turn (cycled) instead of generating"
    )
    seed: int = Field(0, description="seed of the fault draws")

    @field_validator("replies", mode="before")
    @classmethod
    def _texts_are_replies(cls, value: Any) -> Any:
        # A bare string, or strings in the list, are replies without latency.
        if isinstance(value, (str, dict)):
            value = [value]
        if isinstance(value, list):
            return [{"text": v} if isinstance(v, str) else v for v in value]
        return value


FAULTS = ("drop", "error", "hang", "empty")


class FaultInjector:
    """Draws at most one fault per request; one seed gives one fault sequence."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._replies = itertools.cycle(config.replies)

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        """Apply a partial update (validated as a whole); a new `seed` restarts the sequence, new
        `replies` start from their first."""
        if not isinstance(changes, dict):
            raise TypeError(f"expected a JSON object of fault settings, got {type(changes).__name__}")
        self.config = FaultConfig.model_validate({**self.config.model_dump(), **changes})
        if "seed" in changes:
            self._rng.seed(self.config.seed)
        if "replies" in changes:
            self._replies = itertools.cycle(self.config.replies)
        return self.config

    def draw(self) -> str | None:
        # Every switch is drawn on every request, so changing one rate does not shift the others.
        draws = [self._rng.random() for _ in FAULTS]
        for name, draw in zip(FAULTS, draws):
            if draw < getattr(self.config, f"{name}_rate"):
                return name
        return None

    def next_reply(self) -> ScriptedReply:
        return next(self._replies)


def scripted_choice(reply: ScriptedReply, tokenizer: Any, params: GenerationParams, weights: Weights) -> ChoiceResult:
    """A scripted reply as a generated choice: its text's tokens, EOS-terminated (finish "stop")
    unless that exceeds max_tokens (then cut, "length"); every token certain (logprob 0)."""
    ids = tokenizer.encode(reply.text, add_special_tokens=False)
    if tokenizer.eos_token_id is not None and not params.ignore_eos:
        ids.append(tokenizer.eos_token_id)
    finish = "stop"
    if len(ids) > params.max_tokens:
        ids, finish = ids[: params.max_tokens], "length"
    return ChoiceResult(
        token_ids=ids,
        logprobs=[0.0] * len(ids),
        finish_reason=finish,
        sampled_by=[weights] * len(ids),
        top_logprobs=[{t: 0.0} for t in ids] if params.top_logprobs else [],
    )


# -- the command line, derived from FaultConfig -----------------------------------------------------


def add_fault_args(parser: argparse.ArgumentParser) -> None:
    """`--enable-faults`, and one `--fault-<field>` flag per FaultConfig field (`--fault-replies TEXT...` for
    the list); each flag defaults to None so that `fault_config_from_args` can tell one was given."""
    group = parser.add_argument_group("fault injection (tests and benchmarks)")
    group.add_argument(
        "--enable-faults",
        action="store_true",
        help="serve GET/POST /faults, to inject faults at runtime (implied by any --fault-* flag)",
    )
    for name, field in FaultConfig.model_fields.items():
        flag = "--fault-" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        kind = _scalar(field.annotation)
        if kind is list:
            group.add_argument(flag, nargs="+", default=None, metavar="TEXT", help=field.description)
        else:
            group.add_argument(flag, type=kind, default=None, help=f"{field.description} (default {default})")


def fault_config_from_args(args: argparse.Namespace) -> FaultConfig | None:
    """The faults the flags set; None (faults disabled) when neither `--enable-faults` nor a `--fault-*` is given."""
    values = {name: getattr(args, "fault_" + name) for name in FaultConfig.model_fields}
    given = {k: v for k, v in values.items() if v is not None}
    if not given and not args.enable_faults:
        return None
    return FaultConfig.model_validate(given)


def _scalar(annotation: Any) -> type:
    """float, int or list, from a field annotation such as `int | None` or `list[ScriptedReply]`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    return origin if origin is not None else annotation
