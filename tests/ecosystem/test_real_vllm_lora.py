"""LoRA on real vLLM (CPU): the client loads each version's adapter through vLLM's runtime LoRA routes, names it in
its requests, and unloads the ones no request names; the servers' logprobs are the adapter's, and the main job
training a LoRA adapter samples every step with exactly the adapter the trainer trained."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from rich.console import Console

from beam_rl.config import LoraSection, TrainerSection, config_from_dict
from beam_rl.inference.client import InferenceClient
from beam_rl.inference.types import SamplingParams
from beam_rl.rundir import RunDir
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.reference import run_trainer, with_lora
from beam_rl.job.run import run_job
from tests.ecosystem.test_real_vllm import TEMPERATURE, VllmServer, pytestmark  # noqa: F401 (skipped without vLLM)
from tests.support.train_steps import make_samples, write_step

LORA = LoraSection(rank=8, alpha=16)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory):
    """A real vLLM server with runtime LoRA updates (--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    server = VllmServer(tiny_model_dir(), tmp_path_factory.mktemp("vllm-logs") / "vllm-lora.log")
    server.cmd += ["--enable-lora", "--max-lora-rank", str(LORA.rank), "--max-loras", "4"]
    server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    server.start()
    try:
        print(f"vLLM with LoRA ready in {server.wait_ready():.1f}s")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    run = RunDir(tmp_path_factory.mktemp("lora-run"))
    base = load_tiny_model(tiny_model_dir())
    for step in (1, 2):
        write_step(run, step, make_samples(base, step, [1.0] * 4))
    torch.set_num_threads(1)
    run_trainer(run, tiny_model_dir(), TrainerSection(lr=5e-2, lora=LORA), max_steps=2, timeout_s=30)
    return run.weights_path(1), run.weights_path(2)


def _logprobs_of(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1].float() / TEMPERATURE, dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()[len(PROMPT) - 1:]


def test_vllm_samples_each_version_with_its_adapter_and_unloads_the_old_one(vllm_lora, adapters):
    sampling = SamplingParams(max_tokens=6, temperature=TEMPERATURE, seed=11)

    async def main():
        async with InferenceClient(vllm_lora.url, model="tiny", stream=True, lora=True) as client:
            assert await client.serves_lora()
            timings = [await client.update_weights(adapters[0], 1, "keep")]
            first = client.adapter
            (one,) = await client.complete(PROMPT, sampling)
            timings.append(await client.update_weights(adapters[1], 2, "keep"))
            (two,) = await client.complete(PROMPT, sampling)
            return first, client.adapter, timings, one, two

    first, second, timings, one, two = asyncio.run(main())
    assert [t.paused_s for t in timings] == [0.0, 0.0]
    print(f"vLLM loaded an adapter in {', '.join(f'{t.reload_s:.3f}s' for t in timings)}")
    assert one.policy_versions == [1] * 6 and two.policy_versions == [2] * 6
    for choice, path in ((one, adapters[0]), (two, adapters[1])):
        policy = with_lora(load_tiny_model(tiny_model_dir()), LORA, seed=0, adapter_dir=path).eval()
        np.testing.assert_allclose(choice.logprobs, _logprobs_of(policy, PROMPT + choice.token_ids), atol=2e-3)
    served = [m["id"] for m in httpx.get(f"{vllm_lora.url}/v1/models").json()["data"]]
    assert served == ["tiny", second]  # the first was unloaded: no request named it any more
    gone = httpx.post(f"{vllm_lora.url}/v1/completions", json={"model": first, "prompt": PROMPT, "max_tokens": 1})
    assert gone.status_code == 404


def test_the_job_training_a_lora_adapter_on_vllm_samples_each_step_with_exactly_that_adapter(vllm_lora, tmp_path):
    config = config_from_dict({
        "run": {"dir": str(tmp_path), "max_steps": 3},
        "envs": [{"name": "arithmetic_easy", "group_size": 4, "limit": 32}],
        "batch": {"rollouts_per_step": 16},
        "inference": {"urls": [vllm_lora.url], "max_tokens": 8, "temperature": TEMPERATURE, "max_inflight": 16,
                      "request_timeout_s": 120.0},
        "off_policy": {"max_async_level": 0, "max_off_policy_steps": 0},
        "eval": {"every_steps": 0},
        "filters": {"zero_advantage": {"mode": "monitor"}},  # every group trains: three steps from 12 prompts
        "trainer": {"lr": 2e-2, "lora": LORA.model_dump()},
    })
    run_dir = run_job(config, Console(file=io.StringIO(), width=120))
    trained = [m["trainer"] for m in run_dir.read_metrics() if "trainer" in m]
    assert [m["step"] for m in trained] == [1, 2, 3]
    for m in trained:  # vLLM sampled each step's rollouts with the adapter the trainer had just published
        assert m["staleness_max"] == 0 and m["mismatch_kl"] < 1e-3 and abs(m["ratio_mean"] - 1) < 1e-2, m
    assert all((run_dir.weights_path(s) / "adapter_config.json").is_file() for s in (1, 2, 3))
