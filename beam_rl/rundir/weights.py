"""The weights side of a run directory: the trainer publishes weights/step_<N>/ + STABLE, WeightSync reads it."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from beam_rl.rundir.atomic import atomic_write, fsync_directory, fsync_file, json_bytes, temp_path
from beam_rl.rundir.errors import StepAlreadyCommittedError
from beam_rl.rundir.layout import STABLE_FILE, RunLayout, step_dirs


class WeightStore(RunLayout):
    """Published policy weights: a weights/step_<N>/ directory counts only once its STABLE marker exists."""

    def is_stable(self, step: int) -> bool:
        return (self.weights_path(step) / STABLE_FILE).is_file()

    @contextlib.contextmanager
    def publish_weights_dir(self, step: int) -> Iterator[Path]:
        """Yield an empty temp dir to save weights into; on success it becomes weights/step_<N>/ + STABLE.

        On an exception the temp dir is removed and nothing is published.
        """
        final = self.weights_path(step)
        if self.is_stable(step):
            raise StepAlreadyCommittedError(f"{final}: weights of step {step} are already published")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(final)
        tmp.mkdir()
        try:
            yield tmp
            for path in sorted(tmp.rglob("*")):
                if path.is_file():
                    fsync_file(path)
            fsync_directory(tmp)
            if final.exists():
                shutil.rmtree(final)  # unstable leftover of a crashed publish of this step
            os.replace(tmp, final)
            fsync_directory(self.weights_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        stable = json_bytes({"step": step, "published_at": time.time()})
        atomic_write(final / STABLE_FILE, lambda f: f.write(stable))

    def stable_weight_steps(self) -> list[int]:
        return sorted(step for step, path in step_dirs(self.weights_dir) if (path / STABLE_FILE).is_file())

    def latest_stable_weights(self) -> tuple[int, Path] | None:
        steps = self.stable_weight_steps()
        return (steps[-1], self.weights_path(steps[-1])) if steps else None
