"""beam-rl installed as a user installs it: a wheel built from this checkout, in a fresh venv (uv, with the
machine's download cache, bytecode compiled as pip does), without scripts/overrides.txt (so torch brings
triton) and without pip. From a directory outside the checkout, `beam-rl --help` and a two-step `beam-rl run`
of the default embedded servers and trainer exit 0 with nothing from triton's nanobind or a missing pip on
stderr. The model cache starts empty, as on a user's first run, so `beam-rl run` builds the tiny model in its
own process. The finished run then opens in the readers docs/trainer-api.md shows, Hugging Face datasets
included. Slow (about 3 minutes on a busy 2-core machine: most of it compiling the install and the first run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beam_rl.cache import cache_root
from beam_rl.rundir import RunDir
from tests.support.small_run import write_small_run_config
from tests.support.paths import REPO as ROOT, SUPPORT

NOISE = ("nanobind: leaked", "No module named pip")
READERS = ("datasets", "polars", "duckdb")


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("no uv next to this python or on PATH (scripts/setup.sh installs it into .venv)")
    return uv


def _timed(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    """The wheel installed into a fresh venv; a home directory for its runs, outside the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    uv = _uv()
    # Through an sdist: the wheel is built in a directory of its own, never from a stale build/ of the checkout.
    built, build_s = _timed([uv, "build", "--out-dir", str(root / "dist"), str(ROOT)], timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (root / "dist").glob("beam_rl-*.whl")
    venv = root / "venv"
    made = subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stderr
    # Compiled as pip compiles what it installs: else every process of the first run compiles torch and
    # transformers as it imports them, and on a busy machine an embedded server missed its 120 s to start.
    installed, install_s = _timed([uv, "pip", "install", "--compile-bytecode", "--python", str(venv / "bin" / "python"),
                                   str(wheel)], timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert any(venv.glob("lib/python3*/site-packages/triton"))  # the install a user gets: triton comes with torch
    home = root / "home"
    (home / "cache").mkdir(parents=True)
    (home / "cache" / "prism").symlink_to(cache_root() / "prism")  # Prism is built once per machine, not per test
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(BEAM_RL_CACHE=str(home / "cache"), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    print(f"wheel {wheel.stat().st_size / 1e6:.2f} MB, built in {build_s:.1f} s, installed in {install_s:.1f} s")
    return {"uv": uv, "venv": venv, "home": home, "env": env}


def _beam_rl(user: dict, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    proc, took = _timed([str(user["venv"] / "bin" / "beam-rl"), *argv], cwd=user["home"], env=user["env"],
                        timeout=timeout)
    print(f"beam-rl {' '.join(argv)}: {took:.1f} s")
    return proc


def _quiet(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith(NOISE)], proc.stderr[-3000:]


@pytest.fixture(scope="module")
def finished_run(user) -> tuple[subprocess.CompletedProcess, RunDir]:
    config = write_small_run_config(user["home"] / "run.toml", Path("run"), max_steps=2, epochs=10)
    config.write_text(config.read_text().replace('embedded_mode = "instant"\n', ""))  # the default: the tiny model
    return _beam_rl(user, "run", config.name, timeout=600), RunDir(user["home"] / "run")


@pytest.mark.timeout(900)
def test_the_installed_command_runs_from_anywhere_without_exit_noise(user, finished_run):
    helped = _beam_rl(user, "--help", timeout=60)
    _quiet(helped)
    assert "usage: beam-rl" in helped.stdout

    ran, run = finished_run
    _quiet(ran)
    assert run.committed_steps() == [1, 2] and run.stable_weight_steps() == [1, 2]
    assert (user["home"] / "cache" / "models" / "tiny-qwen2-s0").is_dir()  # built by `beam-rl run` itself
    trainer_log = (run.path / "trainer.log").read_text()
    assert not [line for line in trainer_log.splitlines() if line.startswith(NOISE)], trainer_log[-3000:]


@pytest.mark.timeout(900)
def test_the_finished_run_opens_in_each_documented_reader(user, finished_run):
    _, run = finished_run
    python = str(user["venv"] / "bin" / "python")
    added = subprocess.run([user["uv"], "pip", "install", "--python", python, *READERS], capture_output=True,
                           text=True, timeout=600)
    assert added.returncode == 0, added.stderr[-2000:]
    proc = subprocess.run([python, str(SUPPORT / "read_run.py"), str(run.path), "pyarrow", *READERS],
                          cwd=user["home"], env={**user["env"], "HF_HOME": str(user["home"] / "hf")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read_by = json.loads(proc.stdout)
    assert read_by.pop("beam_rl").startswith(str(user["venv"]))  # the wheel's beam_rl, not this checkout's
    records = {step: run.read_commit(step) for step in run.committed_steps()}
    assert read_by == {
        "pyarrow": {str(s): r.window.status["ok"] for s, r in records.items()},
        "polars": {str(s): pytest.approx(r.window.reward_mean, rel=1e-9) for s, r in records.items()},
        "duckdb": {str(s): r.counts.tokens for s, r in records.items()},
        "datasets": {str(s): [r.counts.samples, r.counts.tokens] for s, r in records.items()},
    }
