"""What the run observer shows the outside: one poll's consistent view of a run, the runner's counters as
read at a scrape, and the totals summed over committed steps. Readers (the Prometheus endpoint) depend on
this, not on the observer that fills it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from beam_rl.observe.figures import Figures

BeamCounters = Callable[[], Mapping[str, float]]  # the runner's counters, name -> value, read at each scrape

# Totals over every committed step: commit-record path -> Prometheus counter (beam_rl_<name>_total).
PACKED_TOTALS = {
    ("counts", "groups"): "groups_packed",
    ("counts", "samples"): "samples_packed",
    ("counts", "tokens"): "tokens_packed",
    ("counts", "trained_tokens"): "tokens_trained",
    ("window", "rollouts"): "rollouts_observed",
    ("window", "trained_rollouts"): "rollouts_trained",
}


@dataclass(frozen=True)
class Snapshot:
    """What the run looked like at the end of the last poll; replaced whole, so a scrape from another
    thread always sees one consistent poll."""

    status: dict[str, Any] = field(default_factory=dict)  # the dispatch shards' status files, merged
    steps_committed: int = 0
    last_committed_at: float | None = None
    step: Figures = field(default_factory=dict)  # the last committed step's figures
    totals: dict[str, float] = field(default_factory=dict)  # PACKED_TOTALS names -> sum over committed steps
    tokens_by_fate: dict[str, float] = field(default_factory=dict)  # sum of window.tokens_by_fate, when present
    trainer_step: int = 0
    trainer: Figures = field(default_factory=dict)
    eval_after_step: int = 0
    eval: Figures = field(default_factory=dict)
