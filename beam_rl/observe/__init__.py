"""Observability of a run: experiment trackers (W&B, TensorBoard) and Prometheus, fed by one follower
of the run directory (`RunObserver`). Trackers are imported only when enabled."""

from beam_rl.observe.observer import RunObserver
from beam_rl.observe.snapshot import Snapshot

__all__ = ["RunObserver", "Snapshot"]
