"""verifiers 0.4 (the environment layer prime-rl drives) as two peers of the side-by-side harness: its stock loop
as prime-rl runs it (an env server, `EnvClient.run`, the `null` harness's program per rollout) and its env layer
driven in one process, so the env layer's own cost is separable (bench/peers/verifiers_loop.py runs either, in
verifiers' own venv under the project's cache).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from bench.peers.job import SLOTS_PER_SERVER, PeerJob
from bench.peers.shims.venvs import ensure_venv, peer_dir, uv, venv_python

VERSION = "0.4.0"
PINS = [f"verifiers=={VERSION}", "uv==0.13.9"]  # uv: the `null` harness syncs its chat program's script env with it
REPO = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "shims"


def tokenizer_dir(job: PeerJob, name: str = "tokenizer") -> Path:
    """The served model's tokenizer as files in `job.work_dir / name` (verifiers' renderer loads one by path;
    beam-rl's `tiny` is built in code)."""
    from beam_rl.model.tokenizer import load_tokenizer

    path = job.work_dir / name
    if not (path / "tokenizer.json").exists():
        load_tokenizer(job.model).save_pretrained(str(path))
    return path


def loop_env() -> dict[str, str]:
    """The loop's environment: the shims and the repository importable, the harness's installs (uv, its chat
    program's packages) under the peer's cache, and no model downloads."""
    root = peer_dir("verifiers")
    bin_dir = str(venv_python("verifiers").parent)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO)]),
        "UV_CACHE_DIR": str(root / "uv"),
        "UV_PYTHON_INSTALL_DIR": str(root / "python"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


class _Verifiers:
    MODE = ""
    CANNOT: ClassVar[dict[str, str]] = {}  # a workload or column (bench/peers/table.py) it cannot do, and why

    def unavailable(self) -> str | None:
        try:
            uv()  # what builds its venv
        except RuntimeError as exc:
            return str(exc)
        return None

    def prepare(self) -> None:
        ensure_venv("verifiers", PINS)

    def version(self) -> str:
        return f"verifiers {VERSION}"

    def turns(self, job: PeerJob) -> int:
        return 1

    def command(self, job: PeerJob) -> list[str]:
        job.work_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            str(venv_python("verifiers")), "-m", "bench.peers.verifiers_loop", "--mode", self.MODE,
            "--urls", ",".join(job.urls), "--model", job.model, "--tokenizer", str(tokenizer_dir(job)),
            "--prompts", str(job.prompts_path), "--group-size", str(job.group_size),
            "--max-tokens", str(job.max_tokens), "--groups", str(job.groups), "--out", str(job.out_path),
            "--turns", str(self.turns(job)), "--seed", str(job.seed),
            "--max-concurrent", str(SLOTS_PER_SERVER * len(job.urls)),  # vf-eval's max_concurrent
        ]  # fmt: skip
        return ["env", *(f"{k}={v}" for k, v in loop_env().items() if k not in os.environ or os.environ[k] != v),
                *argv]  # fmt: skip


class VerifiersStock(_Verifiers):
    NAME = "verifiers (stock)"
    MODE = "stock"
    CANNOT: ClassVar[dict[str, str]] = {
        "multi_turn": "its stock `null` harness takes another turn only on a tool call, and the simulated engine "
        "writes none",
    }


class VerifiersInProcess(_Verifiers):
    NAME = "verifiers (in-process)"
    MODE = "inproc"

    def turns(self, job: PeerJob) -> int:
        return 3 if job.name == "multi_turn" else 1
