"""A vLLM scheduler for tests that freezes a request mid-generation until the server is resumed.

Loaded by the real vLLM server of tests/ecosystem/test_real_vllm_updates.py (`--scheduler-cls vllm_hold.HoldingScheduler`,
this folder on its PYTHONPATH), in vLLM's own process: it imports vLLM, nothing of beam-rl. A request whose
sampling parameters carry the extra arguments below is frozen once it has sampled `HOLD_AT` tokens: the
scheduler pauses itself as vLLM's `/pause?mode=keep` does (PAUSED_ALL: nothing is scheduled, every request
keeps its KV cache) and writes the number of tokens sampled so far to the file `HELD`. The next `/resume`
(an update's, or the test's) lets it go on. It is frozen once only: a continuation naming the same file
runs free. So an update asked for once the file exists lands mid-request however long the machine makes
the test wait, where a test racing the engine's sampling through a stream lost on a loaded machine.

The freeze is decided as the token is taken in (`update_from_output`), before vLLM sends it out: a client
that saw the request's `HOLD_AT`-th token can only pause a server that is already frozen.
"""

from __future__ import annotations

from pathlib import Path

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

HOLD_AT = "beam_rl_hold_at"  # extra argument: freeze once the request has sampled this many tokens
HELD = "beam_rl_held"  # extra argument: the file written at the freeze (its name also marks it done)


class HoldingScheduler(Scheduler):
    """vLLM's scheduler on CPU (no async scheduling there), which freezes requests that ask for it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: set[str] = set()

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.running:
            extra = (request.sampling_params.extra_args if request.sampling_params else None) or {}
            held = extra.get(HELD)
            if held and held not in self._held and request.num_output_tokens >= int(extra[HOLD_AT]):
                self._held.add(held)
                self.set_pause_state(PauseState.PAUSED_ALL)
                written = Path(f"{held}.tmp")  # whole or absent: the test reads it once it exists
                written.write_text(str(request.num_output_tokens))
                written.replace(held)
        return outputs
