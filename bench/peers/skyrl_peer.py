"""SkyRL 0.4 as a peer of the side-by-side harness: its simulated fully-async trainer
(`skyrl/train/fully_async_trainer_sim.py`: the real generation loop, training a sleep, each weight sync a pause,
a sleep and a resume). It does not run on this machine; `unavailable()` says exactly why (bench/peers/README.md
lists what was tried).
"""

from __future__ import annotations

from typing import ClassVar

from bench.peers.job import PeerJob

VERSION = "0.4.0"

# What was found trying it here (Python 3.11.7, no GPU), in order: pip refuses the release (Requires-Python
# >=3.12); installed with that overridden (`uv pip install --python-version 3.12`, then torch 2.13.0 reinstalled
# for 3.11, whose cp312 build that brought cannot load) and the skyrl-train extra's pure-Python packages added
# (torchdata, tensordict, peft, skyrl-gym, ...), every module parses on 3.11, but importing the simulated trainer
# stops in skyrl/tinker/types.py (imported by skyrl.backends): a pydantic model holds `MultiModalKwargs`, a
# `typing.TypedDict`, which pydantic refuses below Python 3.12. Past that, the extra pins CUDA builds (flash-attn
# 2.8.3 from source, nixl, vllm-router), and the sim's entrypoint ships only in the source repository.
REASON = (
    f"skyrl {VERSION} requires Python >=3.12 and this machine has 3.11 only: with that overridden, importing "
    "skyrl.train.fully_async_trainer_sim fails in skyrl/tinker/types.py (PydanticUserError: a pydantic model "
    "holds a typing.TypedDict, `MultiModalKwargs`; pydantic needs typing_extensions.TypedDict on Python < 3.12)"
)


class SkyRL:
    NAME = "skyrl (simulated trainer)"
    CANNOT: ClassVar[dict[str, str]] = {}  # it does not run here at all: unavailable()

    def unavailable(self) -> str | None:
        return REASON

    def prepare(self) -> None:
        raise RuntimeError(REASON)

    def version(self) -> str:
        return f"skyrl {VERSION}"

    def command(self, job: PeerJob) -> list[str]:
        raise RuntimeError(REASON)
