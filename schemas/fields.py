"""Every column of the run directory's Arrow files, declared once: its name, type and meaning.

The Arrow schemas, the domain's Sample and RolloutRecord, the writers, the reader and the coder's size
estimate are all derived from these tables, so a field added here reaches each of them.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa


class _Required:
    """The default of a field that has none."""

    def __repr__(self) -> str:
        return "REQUIRED"


_REQUIRED: Any = _Required()


@dataclass(frozen=True)
class TokenField:
    """A per-token column of a rank file (list<dtype>): one value per token of a sample."""

    name: str
    dtype: type[np.generic]  # of the Sample's array and of the reader's; bool is stored as uint8 0/1 (below)
    meaning: str
    fill: int | float | None = None  # the value of every token when a Sample leaves the field out; None: required
    written: bool = False  # computed by the writer, not held by a Sample

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def arrow_type(self) -> pa.DataType:
        # Arrow bit-packs bools, which could not be memory-mapped as a numpy array: uint8 can.
        return pa.uint8() if self.dtype == np.bool_ else pa.from_numpy_dtype(self.dtype)


@dataclass(frozen=True)
class SampleField:
    """A per-sample column of a rank file: one value per sample (row)."""

    name: str
    arrow_type: pa.DataType
    meaning: str
    key: str  # the reader's name for a micro-batch's values of it
    default: Any = _REQUIRED  # for a Sample built without it
    written: bool = False  # computed by the writer, not held by a Sample


RolloutSource = Literal["rollout", "record", "computed", "tokens"]


@dataclass(frozen=True)
class RolloutField:
    """A column of window.arrow: one value per rollout.

    `source` says where the value lives: "rollout", an attribute set on the Rollout by dispatch or
    scoring and copied into its RolloutRecord; "record", an attribute set on the RolloutRecord later
    (None until then); "computed", a property of both; "tokens", cut from the record's RolloutTokens.
    """

    name: str
    arrow_type: pa.DataType
    meaning: str
    source: RolloutSource = "rollout"
    attr: str = ""  # the Python attribute; default: the column's name
    nullable: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "attr", self.attr or self.name)


@dataclass(frozen=True)
class TurnField:
    """A field of each turn in window.arrow's `turns` column (a list of structs, one per turn).

    With a `segment`, it holds one value per token of that segment of the turn, cut from the RolloutTokens
    array named `source`; without, one value per turn from the RolloutTokens list named `source`."""

    name: str
    arrow_type: pa.DataType  # of one value
    meaning: str
    source: str
    segment: Literal["env", "completion"] | None = None
    nullable: bool = False

    @property
    def column_type(self) -> pa.DataType:
        return pa.list_(self.arrow_type) if self.segment else self.arrow_type


# -- rank_<R>.arrow: one row per sample, one record batch per micro-batch ------------------------------

SAMPLE_FIELDS: tuple[SampleField, ...] = (
    SampleField(
        "micro_batch",
        pa.int32(),
        "index of the sample's micro-batch in the file (one record batch each)",
        key="micro_batch",
        written=True,
    ),
    SampleField("seq_len", pa.int32(), "the sample's token count", key="seq_lens", written=True),
    SampleField("rollout_id", pa.string(), "the rollout it was cut from: `<group_id>/<attempt>`", key="rollout_ids"),
    SampleField("group_id", pa.string(), "the rollout's group: `e<epoch>-i<row>`", key="group_ids"),
    SampleField(
        "policy_version", pa.int32(), "the policy version the rollout started on", key="sample_policy_versions"
    ),
    SampleField(
        "reward",
        pa.float64(),
        "the rollout's reward, as the environment gave it (float32 in schema version 2)",
        key="rewards",
        default=0.0,
    ),
)

TOKEN_FIELDS: tuple[TokenField, ...] = (
    TokenField("input_ids", np.int32, "token ids: the prompt, then each turn's environment and completion tokens"),
    TokenField("position_ids", np.int32, "position within the sample, restarting at 0 on every sample", written=True),
    TokenField("loss_mask", np.bool_, "true on tokens the model generated (the ones to train on)"),
    TokenField("advantages", np.float32, "the rollout's advantage on generated tokens, 0 on context"),
    TokenField(
        "logprobs",
        np.float32,
        "the inference engine's logprob of each generated token (after temperature), 0 on context",
    ),
    TokenField("temperatures", np.float32, "the sampling temperature (the trainer divides logits by it)"),
    TokenField(
        "policy_versions",
        np.int32,
        "the policy version that sampled each generated token; -1 on context and where unknown",
        fill=-1,
    ),
)

# -- window.arrow: one row per rollout seen since the previous step -----------------------------------

TURN_FIELDS: tuple[TurnField, ...] = (
    TurnField(
        "env_ids",
        pa.int32(),
        "tokens the environment appended before the turn (context; none on turn 0)",
        source="input_ids",
        segment="env",
    ),
    TurnField(
        "completion_ids",
        pa.int32(),
        "the exact ids the server returned, EOS and stop tokens included",
        source="input_ids",
        segment="completion",
    ),
    TurnField(
        "logprobs",
        pa.float32(),
        "the inference engine's logprob of each completion token",
        source="logprobs",
        segment="completion",
    ),
    TurnField(
        "policy_versions",
        pa.int32(),
        "the policy version that sampled each completion token; -1 unknown",
        source="policy_versions",
        segment="completion",
    ),
    TurnField(
        "finish_reason",
        pa.string(),
        "why generation stopped: stop, length (truncated), ...; null unknown",
        source="finish_reasons",
        nullable=True,
    ),
)

TURNS_TYPE = pa.list_(pa.struct([pa.field(f.name, f.column_type, nullable=f.nullable) for f in TURN_FIELDS]))

# Why tokens generated for a rollout were thrown away (beam_rl/packing/goodput.py): too stale (regenerated or
# cancelled), lost with a failed server, cancelled at shutdown, lost with an error of the rollout's own.
DISCARD_FATES = ("stale", "server_failure", "cancelled", "errored")
DISCARDED_TOKENS_TYPE = pa.struct([pa.field(fate, pa.int32()) for fate in DISCARD_FATES])

ROLLOUT_FIELDS: tuple[RolloutField, ...] = (
    # which rollout
    RolloutField("rollout_id", pa.string(), "`<group_id>/<attempt>`", source="computed"),
    RolloutField("group_id", pa.string(), "`e<epoch>-i<row>`: one prompt (dataset row) of one epoch"),
    RolloutField("env", pa.string(), "the environment's name", attr="env_name"),
    RolloutField("epoch", pa.int32(), "the pass over the environment's dataset"),
    RolloutField("index", pa.int64(), "the prompt's row in the environment's dataset"),
    RolloutField("attempt", pa.int32(), "the rollout's index within its group"),
    RolloutField("is_eval", pa.bool_(), "a held-out evaluation rollout (never trained on)"),
    # what became of it
    RolloutField("status", pa.string(), "how it left dispatch: a RolloutStatus value (ok, error, cancelled, ...)"),
    # float64, the reward's own type: replay scores exactly what the run scored (float32 in schema version 2).
    RolloutField("reward", pa.float64(), "the environment's reward (0 unless ok)"),
    RolloutField("advantage", pa.float32(), "the group algorithm's advantage (0 unless ok)"),
    RolloutField("filtered", pa.string(), "the filter that kept it from training; null: clean", nullable=True),
    RolloutField("num_turns", pa.int32(), "model generations in the trajectory", source="computed"),
    RolloutField("completion_tokens", pa.int32(), "tokens the model generated, all turns", source="computed"),
    RolloutField("truncated", pa.bool_(), "the last turn stopped at the token limit", source="computed"),
    RolloutField(
        "discarded_tokens",
        DISCARDED_TOKENS_TYPE,
        "tokens generated for it that are not in its turns "
        "(earlier tries, a cancelled or failed one's), by why they were thrown away: " + ", ".join(DISCARD_FATES),
    ),
    # policy versions
    RolloutField("policy_version_start", pa.int32(), "the policy version when its request was sent"),
    RolloutField("policy_version_end", pa.int32(), "the policy version when it finished"),
    RolloutField(
        "token_version_min",
        pa.int32(),
        "the oldest version that sampled one of its tokens; null: none known",
        source="computed",
        nullable=True,
    ),
    RolloutField(
        "token_version_max",
        pa.int32(),
        "the newest version that sampled one of its tokens; null: none known",
        source="computed",
        nullable=True,
    ),
    # where it ran
    RolloutField("server", pa.string(), "the inference server's URL; null: never sent", nullable=True),
    RolloutField("dispatch_worker", pa.string(), "host:pid of the worker that dispatched it"),
    RolloutField("score_worker", pa.string(), "host:pid of the worker that scored it"),
    RolloutField("errors", pa.list_(pa.string()), "what went wrong, in order"),
    # timeline, Unix seconds
    RolloutField("t_admitted", pa.float64(), "the dispatcher opened its group; null: cancelled before", nullable=True),
    RolloutField("t_sent", pa.float64(), "its request started (for an attempt never sent: when it was given up)"),
    RolloutField("t_first_token", pa.float64(), "its first token streamed back; null: not reported", nullable=True),
    RolloutField("t_finished", pa.float64(), "its request finished (or failed, or was cancelled)"),
    RolloutField("t_scored", pa.float64(), "the scoring stage had rewarded its group", nullable=True),
    RolloutField(
        "t_packed", pa.float64(), "the packer cut the step whose window holds it", source="record", nullable=True
    ),
    RolloutField(
        "t_committed",
        pa.float64(),
        "the writer committed that step: wrote this file, after its rank "
        "files, before COMMIT.json (null only in memory)",
        source="record",
        nullable=True,
    ),
    # its tokens, so a step can be read back as text and replayed
    RolloutField(
        "prompt_ids",
        pa.list_(pa.int32()),
        "the prompt's token ids; null: tokens unreadable (see errors)",
        source="tokens",
        nullable=True,
    ),
    RolloutField(
        "turns",
        TURNS_TYPE,
        "one struct per turn: " + ", ".join(f.name for f in TURN_FIELDS) + "; null: tokens unreadable",
        source="tokens",
        nullable=True,
    ),
)

SAMPLE_TOKEN_FIELDS = tuple(f for f in TOKEN_FIELDS if not f.written)  # the per-token arrays a Sample holds
# The token arrays a clean rollout's record and its sample share (RolloutTokens' and Sample's).
SHARED_TOKEN_ARRAYS = tuple(dict.fromkeys(f.source for f in TURN_FIELDS if f.segment))


# -- the domain classes whose attributes are these fields ---------------------------------------------


def sample_attributes() -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of a Sample: its per-token arrays, then its per-sample values."""
    tokens = [
        (f.name, np.ndarray | None if f.fill is not None else np.ndarray, None if f.fill is not None else _REQUIRED)
        for f in SAMPLE_TOKEN_FIELDS
    ]
    return tokens + [(f.name, _python_type(f.arrow_type), f.default) for f in SAMPLE_FIELDS if not f.written]


def record_attributes() -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of a RolloutRecord's stored values (computed and token columns are not)."""
    return [
        (
            f.attr,
            _python_type(f.arrow_type) | None if f.nullable else _python_type(f.arrow_type),
            None if f.source == "record" else _REQUIRED,
        )
        for f in ROLLOUT_FIELDS
        if f.source in ("rollout", "record")
    ]


def declared(attributes: Iterable[tuple[str, Any, Any]]) -> Callable[[type], type]:
    """A class decorator: the class becomes a keyword-only dataclass whose fields are `attributes`,
    followed by the ones the class annotates itself, so the class and its columns cannot drift apart."""

    def wrap(cls: type) -> type:
        own = inspect.get_annotations(cls)
        annotations = {}
        for name, annotation, default in attributes:
            annotations[name] = annotation
            if default is not _REQUIRED:
                setattr(cls, name, default)
        cls.__annotations__ = {**annotations, **own}
        return dataclass(kw_only=True)(cls)

    return wrap


def numpy_dtype(arrow_type: pa.DataType) -> np.dtype[Any]:
    """The numpy dtype of a primitive Arrow type (pyarrow's own `to_pandas_dtype` needs pandas)."""
    return _NUMPY_DTYPES[arrow_type]


_NUMPY_DTYPES = {
    pa.from_numpy_dtype(d): np.dtype(d)
    for d in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
    )
}


def _python_type(arrow_type: pa.DataType) -> Any:
    if pa.types.is_list(arrow_type):
        return types.GenericAlias(list, _python_type(arrow_type.value_type))
    for check, python_type in (
        (pa.types.is_boolean, bool),
        (pa.types.is_integer, int),
        (pa.types.is_floating, float),
        (pa.types.is_string, str),
    ):
        if check(arrow_type):
            return python_type
    return Any
