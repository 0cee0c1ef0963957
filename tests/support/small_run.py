"""The small run that the process-level tests (Ctrl-C, SIGKILL) start as `beam-rl run`: embedded
instant servers, a 4-rollout group per prompt, 16 rollouts per step."""

from __future__ import annotations

from pathlib import Path

_TOML = """
[run]
dir = "{run_dir}"
max_steps = {max_steps}
[model]
max_context = 256
[inference]
embedded_mode = "instant"
max_tokens = 8
max_inflight = 32
[[envs]]
name = "reverse_text"
group_size = 4
epochs = {epochs}
[batch]
rollouts_per_step = 16
seq_len = 256
"""


def write_small_run_config(path: Path, run_dir: Path, max_steps: int, epochs: int) -> Path:
    path.write_text(_TOML.format(run_dir=run_dir, max_steps=max_steps, epochs=epochs))
    return path
