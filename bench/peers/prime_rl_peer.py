"""prime-rl's orchestrator as a peer of the side-by-side harness: its own env server and orchestrator from a source
checkout (not on PyPI: `BEAM_RL_PRIME_RL_SRC`, pinned by commit, kept outside the repository), a fake trainer on
the trainer's side of its filesystem transports, and the `reverse-text` shape of prime-rl's smallest example (a
single-turn taskset, the `null` harness on the subprocess runtime), run by bench/peers/shims/prime_rl_run.py in
prime-rl's own venv under the project's cache.

prime-rl declares Python ~=3.12 and GPU-only packages; here it runs on 3.11 from the checkout's `src` (not
installed, so its requires-python is not checked), with its GPU-only imports stubbed
(bench/peers/shims/prime_rl_stubs) and its pure-Python dependencies pinned to its `uv.lock`.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import ClassVar

from bench.peers.job import SLOTS_PER_SERVER, PeerJob
from bench.peers.shims.venvs import ensure_venv, peer_dir, venv_python
from bench.peers.verifiers_peer import REPO, SHIMS, tokenizer_dir

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"  # the snapshot these pins and stubs were made against
DEFAULT_SRC = peer_dir("prime-rl-src")
# Its uv.lock's versions, except: verifiers and prime-pydantic-config (git submodules there: their PyPI
# releases here), torch (its CUDA 12.8 index is out of reach: PyPI's build, which runs on CPU), torchao (its
# own cp312 wheel: PyPI's), prime (the lock's 0.6.19 imports a prime-sandboxes name verifiers 0.4.0's does not
# have: the release that matches it).
PINS = [
    "verifiers==0.4.0", "prime-pydantic-config==0.4.3", "prime==0.18.0", "torch==2.13.0", "torchao==0.17.0",
    "transformers==5.6.2", "wandb==0.27.0", "wandb-workspaces==0.4.3", "nvidia-ml-py==13.595.45",
    "grpcio==1.80.0", "psutil==7.2.2", "loguru==0.7.3", "aiolimiter==1.2.1", "tenacity==9.1.4",
    "orjson==3.11.9", "rich==15.0.0", "setproctitle==1.3.7", "uvloop==0.22.1", "msgspec==0.21.1",
    "pybase64==1.4.3", "numpy==2.3.5", "pandas==3.0.3", "pyarrow==24.0.0", "datasets==4.6.1",
    "prometheus-client==0.25.0", "beartype==0.22.9", "jaxtyping==0.3.10", "tomli==2.4.1", "tomli-w==1.2.0",
    "uv==0.13.9",
]  # fmt: skip
TRAIN_S = 1.0  # the fake trainer's step
BATCH_GROUPS = 8  # groups per trainer step


def source() -> Path:
    return Path(os.environ.get("BEAM_RL_PRIME_RL_SRC", DEFAULT_SRC))


def toml(value: object) -> str:
    """A TOML value (strings, numbers, lists of strings: JSON spells them the same)."""
    return json.dumps(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_tables(prefix: str, job: PeerJob) -> str:
    """The environment: the harness's prompts as a taskset, prime-rl's `reverse-text` harness and runtime."""
    return (
        f"[{prefix}env.taskset]\nid = \"vf_peer_prompts\"\nprompts_path = {toml(str(job.prompts_path))}\n"
        f"[{prefix}env.agent.harness]\nid = \"null\"\n[{prefix}env.agent.runtime]\ntype = \"subprocess\"\n"
    )


def write_configs(job: PeerJob, output_dir: Path) -> tuple[Path, Path]:
    port = free_port()
    urls = [f"{url.rstrip('/')}/v1" for url in job.urls]
    env_server = job.work_dir / "env-server.toml"
    env_server.write_text(
        f"output_dir = {toml(str(output_dir))}\n" + env_tables("", job)
        + f"[serve]\naddress = {toml(f'tcp://127.0.0.1:{port}')}\n"
    )  # fmt: skip
    batch = BATCH_GROUPS * job.group_size
    in_flight = max(SLOTS_PER_SERVER * len(job.urls), job.group_size)  # its adaptive cap, pinned
    orchestrator = job.work_dir / "orchestrator.toml"
    orchestrator.write_text(
        f"output_dir = {toml(str(output_dir))}\nbatch_size = {batch}\ngroup_size = {job.group_size}\n"
        f"max_steps = {math.ceil(job.groups / BATCH_GROUPS) + 1}\nenv_server_base_port = {port}\n"
        "collect_inference_metrics = false\n"
        f"[model]\nname = {toml(job.model)}\n"
        # One sampling URL: prime-rl spreads over replicas through a router (vllm-router); admin calls (pause,
        # resume, /update_weights) go to every server.
        f"[model.client]\nbase_url = {toml(urls[0])}\nadmin_base_url = {toml(urls)}\n"
        "api_key_var = \"BEAM_RL_PEER_KEY\"\n"
        # prime-rl's renderer loads the tokenizer by the served model's name: the orchestrator runs in
        # `job.work_dir`, where a folder of that name holds it (`command`).
        f"[tokenizer]\nname = {toml(str(tokenizer_dir(job, job.model)))}\n[renderer]\nname = \"default\"\n"
        f"[concurrency]\nmin_inflight = {in_flight}\nmax_inflight = {in_flight}\n"
        "[weight_broadcast]\ntype = \"filesystem\"\n[rollout_transport]\ntype = \"filesystem\"\n"
        f"[train.sampling]\nmax_completion_tokens = {job.max_tokens}\n"
        "[[train.source]]\nname = \"peers\"\n" + env_tables("train.source.", job)
    )  # fmt: skip
    return orchestrator, env_server


class PrimeRL:
    NAME = "prime-rl"
    # A workload or column (bench/peers/table.py COLUMNS) it cannot do, and why. Not a column, so said here: it
    # samples from the first server only (prime-rl spreads over replicas through a router, vllm-router, a binary
    # from its GitHub releases); the other servers get its admin calls (pause, resume, /update_weights).
    CANNOT: ClassVar[dict[str, str]] = {
        "multi_turn": "its stock `null` harness takes another turn only on a tool call, and the simulated engine "
        "writes none",
    }

    def unavailable(self) -> str | None:
        src = source()
        if not (src / "src" / "prime_rl" / "orchestrator" / "orchestrator.py").exists():
            return f"no prime-rl checkout at {src} (set BEAM_RL_PRIME_RL_SRC to one at commit {COMMIT[:9]})"
        return None

    def prepare(self) -> None:
        ensure_venv("prime-rl", PINS)

    def version(self) -> str:
        stamp = source() / "COMMIT"
        return f"prime-rl {stamp.read_text().strip()[:9] if stamp.exists() else 'unknown commit'}"

    def command(self, job: PeerJob) -> list[str]:
        job.work_dir.mkdir(parents=True, exist_ok=True)
        output_dir = job.work_dir / "outputs"
        orchestrator, env_server = write_configs(job, output_dir)
        src = source()
        path = [SHIMS / "prime_rl_stubs", SHIMS, REPO, src / "src", src / "packages" / "prime-rl-configs" / "src"]
        env = {
            "PYTHONPATH": os.pathsep.join(str(p) for p in path),
            "PATH": f"{venv_python('prime-rl').parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
            "UV_CACHE_DIR": str(peer_dir("prime-rl") / "uv"),
            "UV_PYTHON_INSTALL_DIR": str(peer_dir("prime-rl") / "python"),
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "BEAM_RL_PEER_KEY": "EMPTY",
        }
        return [
            "env", "--chdir", str(job.work_dir), *(f"{k}={v}" for k, v in env.items()),
            str(venv_python("prime-rl")), str(SHIMS / "prime_rl_run.py"), "--orchestrator", str(orchestrator),
            "--env-server", str(env_server), "--out", str(job.out_path), "--output-dir", str(output_dir),
            "--train-s", str(TRAIN_S),
        ]  # fmt: skip
