"""beam-rl: the rollout side of LLM reinforcement learning as an Apache Beam streaming pipeline."""

from setuptools import find_packages, setup

# One Beam version everywhere: the Python SDK, the Prism binary (built from the Go module at this
# version) and the Flink job server (assembled from the Maven artifacts at this version) must match.
# 2.70.0 is the newest release whose Flink runner (beam-runners-flink-1.19) the Maven registry reachable
# here serves and for which a Flink job server can be assembled (beam-runners-java-job-service stops at
# 2.65.0; runners/bootstrap.py supplies it). 2.72+ would also pin pillow<13, which vllm 0.33 cannot share.
# See docs/runners.md.
BEAM_VERSION = "2.70.0"

setup(
    name="beam-rl",
    version="0.1.0",
    description="RL rollout orchestration for LLMs as an Apache Beam streaming pipeline",
    python_requires=">=3.11",  # tomllib (beam_rl/config.py)
    packages=find_packages(include=["beam_rl*", "transforms*", "runners*", "schemas*"]),
    package_data={"beam_rl": ["envs/data/*.jsonl"],
                  # Prism and the Flink job server are built with them (runners/bootstrap.py)
                  "runners": ["prism_patches/*.patch", "job_server_patches/*.patch"]},
    install_requires=[
        f"apache-beam=={BEAM_VERSION}",
        "pyarrow>=14,<19",  # apache-beam 2.70 requires pyarrow<19 (18.x is the newest it allows)
        "numpy>=1.26,<2.3",
        "pydantic>=2.6,<3",
        "xxhash>=2",  # the commit record's file checksums (XXH3-128)
        "httpx>=0.27",  # the benchmark's and tests' plain HTTP calls
        "mmh3>=5,<6",  # Beam's Flink runner hashes keys with murmur3 (transforms/flink_keys.py)
        "orjson>=3.9",  # the dispatcher parses every completion; json was half its CPU
        "prometheus-client>=0.20",
        "pyyaml>=6",  # the Flink cluster config (runners/flink_cluster.py)
        "aiohttp>=3.10",  # the inference client and the embedded server
        "dnspython>=2.6,<3",  # a fleet named by DNS (beam_rl/fleet/dns_fleet.py)
        "rich>=13",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        # Its Linux wheel requires triton (1 GB), for torch.compile on GPUs, which beam-rl never uses: without a
        # GPU its own processes hide it (beam_rl.processes.keep_triton_out). To leave it out, uv's --override
        # with a file holding `triton; sys_platform == "never"` (scripts/overrides.txt); pip cannot: uninstall it.
        "torch>=2.3",
        "peft>=0.13",  # LoRA adapters: the trainer trains and publishes them, the embedded server serves them
        "matplotlib>=3.8",
        # Beam 2.70 allows protobuf<7 (6.33.x resolves here); verifiers needs >= 6.31. No pin of our own:
        # apache-beam's and verifiers' ranges decide.
        # Experiment trackers (imported only when [logging] enables them). Ranges as tested: W&B's
        # transaction-log format is read back on resume (beam_rl/observe/wandb_history.py); both must
        # resolve with apache-beam's grpcio<1.66 (still its pin on Python 3.11 at 2.70): tensorboard 2.21
        # needs grpcio>=1.74; the index serves no wandb newer than 0.31 (both re-checked with Beam 2.70).
        "wandb>=0.31,<0.32",
        "tensorboard>=2.20,<2.21",
        # The verifiers environment (beam_rl/envs/verifiers_env.py): its v1 tasksets' reward functions score
        # rollouts inside the pipeline's workers. It needs protobuf>=6.31, which Beam 2.70 allows.
        "verifiers==0.4.0",
    ],
    extras_require={
        "vllm": ["vllm"],
        # cryptography: self-signed certs for https tests; openai: the black-box agent the tests run (tests/support/agents);
        # polars, duckdb: readers docs/trainer-api.md shows. Not Hugging Face datasets: its releases that allow
        # pyarrow<19 pin fsspec<=2025.3.0; tests/ecosystem/test_wheel.py installs it in a venv of its own.
        # ruff, mypy, types-PyYAML: scripts/check.sh, pinned so that a new release's rules do not fail CI.
        # llmd-benchmark-report: the side-by-side's results in llm-d's Benchmark Report format (bench/peers/report.py).
        # pytest-xdist: the fast tier runs on every core (scripts/test.sh --fast).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "cryptography>=42", "openai>=1.40",
                 "polars>=1", "duckdb>=1.1", "ruff==0.17.5", "mypy==2.4.1", "types-PyYAML==6.0.12.20261113",
                 "llmd-benchmark-report>=0.2.1,<0.3"],
    },
    entry_points={"console_scripts": ["beam-rl=beam_rl.cli:main"]},
)
