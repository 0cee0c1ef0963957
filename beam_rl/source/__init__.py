"""The prompt source and dispatcher of one shard, and the rules it keeps (Beam-free)."""

from beam_rl.source.restriction import DispatchRange, InFlight, Redo
from beam_rl.source.shard import Shard
from beam_rl.source.source import EndOfInput, RolloutSource, SourceSpec
from beam_rl.source.status import AllServersDownError

__all__ = [
    "AllServersDownError",
    "DispatchRange",
    "EndOfInput",
    "InFlight",
    "Redo",
    "RolloutSource",
    "Shard",
    "SourceSpec",
]
