"""What can go wrong with a run directory, as types a caller can catch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RunDirError(OSError):
    """The run directory cannot be used (not writable, not a directory, disk full while writing a step, ...)."""


class MetricsError(RunDirError, ValueError):
    """metrics.jsonl holds a line that is not a JSON object (other than a torn last line)."""


class StepAlreadyCommittedError(FileExistsError):
    """Writing a step that is already committed: steps are written exactly once."""


class StepNotCommittedError(FileNotFoundError):
    """Reading a step whose commit record does not exist (yet)."""


class StepCorruptError(RunDirError):
    """A file of a committed step is missing, unreadable, or not what its commit record lists."""

    def __init__(self, step: int, file: Path, what: str) -> None:
        super().__init__(f"{file}: step {step} is corrupt: {what}")
        self.step = step
        self.file = file
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes (Beam workers) with its own arguments
        return type(self), (self.step, self.file, self.what)
