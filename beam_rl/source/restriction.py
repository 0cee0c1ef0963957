"""What one shard of the dispatch source has left to do, as the runner checkpoints it.

Beam-free: the Beam tracker (transforms/dispatch.py) claims offsets from it and splits it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from beam_rl.dispatch.resume import ResumePoint

Redo = tuple[tuple[int, tuple[int, ...]], ...]  # (schedule position, attempts) pairs


@dataclass(frozen=True)
class InFlight:
    """What the offsets alone cannot say about a shard when its restriction is saved:

    - `redo`: attempts of groups claimed earlier whose rollouts had not left the source yet.
      Downstream state in the same checkpoint lacks them, so a restore runs them again.
    - `emitted`: how many groups had left the source whole (the packer's restored count of groups seen
      agrees with it, so the end of input is announced with the right total).
    - `resume`: of those, the ones that were generating, with their tokens so far (dispatch/resume.py):
      a restore continues them from there. Taken at the end of each process() call (`dispatch.
      checkpoint_tokens`); a split mid-call carries the last one taken.
    - `token`: names the process() call that saved it. A worker process that outlived a restore (the
      runner went back to an older checkpoint) still holds a source ahead of it; a token the source did
      not hand out tells it so.
    """

    redo: Redo = ()
    emitted: int = 0
    token: str | None = None
    resume: tuple[ResumePoint, ...] = ()


@dataclass
class DispatchRange:
    """Offsets [start, stop) of a shard's part of the prompt schedule still to claim (the last one,
    stop - 1, is the end marker), and what was in flight when it was saved. The process() call working
    on a range keeps `in_flight` current as rollouts leave; a checkpoint's residual takes a copy.

    Each offset claimed is one prompt drawn from one stream of the schedule. With several streams (mixing
    by ratio) the source chooses the stream, and `draws` counts, per stream, the draws made before
    `start`; the tracker counts them as it claims, so they always agree with `start`. Empty: none yet,
    or a one-stream schedule, whose draws are the offsets."""

    start: int
    stop: int
    in_flight: InFlight = field(default_factory=InFlight)
    draws: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"bad dispatch range [{self.start}, {self.stop})")

    @property
    def end_marker(self) -> int:
        return self.stop - 1

    def size(self) -> int:
        """The work left: offsets to claim plus groups to redo (what runners balance on)."""
        return self.stop - self.start + len(self.in_flight.redo)
