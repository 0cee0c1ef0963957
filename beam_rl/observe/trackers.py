"""What the run observer asks of an experiment tracker (W&B, TensorBoard): log each stream's steps once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from beam_rl.observe.figures import Figures

# One sample rollout of a step, as the W&B table shows it: column name -> text or number.
Sample = Mapping[str, str | int | float]


class Tracker(Protocol):
    name: str
    # The last step logged per stream (0: none). Read from the tracker's own files when it opens, then
    # kept current by `log`: a step is logged only if it is past its stream's entry.
    logged: dict[str, int]

    def log(self, stream: str, step: int, figures: Figures, samples: list[Sample] | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
