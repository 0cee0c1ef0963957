"""A stand-in trainer for benchmarks that need the policy to move: it publishes the tiny model's own weights
as each step commits."""

from __future__ import annotations

import shutil
import threading

from beam_rl.model.tiny import tiny_model_dir
from beam_rl.rundir import RunDir


class PublishEveryStep(threading.Thread):
    """A stand-in trainer: publishes weights (the tiny model's own tensors) as soon as each step commits."""

    def __init__(self, run_dir: RunDir) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.stop = run_dir, threading.Event()

    def run(self) -> None:
        latest = self.run_dir.latest_stable_weights()  # a resumed run's trainer goes on from its weights
        published, files = (latest[0] if latest else 0), [f for f in tiny_model_dir().iterdir() if f.is_file()]
        while not self.stop.wait(0.02):
            for step in range(published + 1, (self.run_dir.last_committed_step() or 0) + 1):
                with self.run_dir.publish_weights_dir(step) as directory:
                    for file in files:
                        shutil.copy(file, directory)
                published = step
