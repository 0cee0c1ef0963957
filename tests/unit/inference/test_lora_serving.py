"""LoRA from trainer to server: the embedded server's runtime LoRA routes (vLLM's), and the client loading each
version's adapter, naming it in its requests, stamping exact versions across an update, and unloading adapters
no request names any more."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from beam_rl.wiring import job_parts
from beam_rl.config import LoraSection, TrainerSection, config_from_dict
from beam_rl.inference.client import InferenceClient, InferenceError
from beam_rl.inference.types import SamplingParams
from beam_rl.rundir import RunDir
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.standin.faults import FaultConfig
from beam_rl.model.tiny import load_tiny_model
from beam_rl.trainer.reference import run_trainer, with_lora
from tests.support.train_steps import make_samples, write_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = LoraSection(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    """Two published adapters of the tiny model (steps 1 and 2 of a LoRA run), trained hard enough to move
    the logprobs."""
    run = RunDir(tmp_path_factory.mktemp("lora-run"))
    base = load_tiny_model(model_dir)
    for step in (1, 2):
        write_step(run, step, make_samples(base, step, [1.0] * 4))
    run_trainer(run, model_dir, TrainerSection(lr=5e-2, lora=LORA), max_steps=2, timeout_s=30)
    return run.weights_path(1), run.weights_path(2)


def _logprobs_of(model, ids: list[int]) -> np.ndarray:
    """log pi(ids[t] | ids[:t]) for t >= len(PROMPT): what a server sampling `ids` with `model` reports."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp.numpy()[len(PROMPT) - 1:]


def test_a_request_naming_an_adapter_samples_with_it_and_is_stamped_with_its_version(
        start_embedded, model_dir, adapters):
    server = start_embedded(model_dir, enable_lora=True)
    policy = with_lora(load_tiny_model(model_dir), LORA, seed=0, adapter_dir=adapters[0]).eval()

    async def main():
        async with InferenceClient(server.url, stream=True, lora=True) as client:
            (before,) = await client.complete(PROMPT, SamplingParams(max_tokens=6, seed=1))
            timing = await client.update_weights(adapters[0], 1, "keep")
            (after,) = await client.complete(PROMPT, SamplingParams(max_tokens=6, seed=1))
            return client.adapter, timing, before, after

    adapter, timing, before, after = asyncio.run(main())
    assert (timing.mode, timing.paused_s) == ("keep", 0.0)  # no pause: requests in flight keep their adapter
    assert before.policy_versions == [0] * 6 and after.policy_versions == [1] * 6
    np.testing.assert_allclose(after.logprobs, _logprobs_of(policy, PROMPT + after.token_ids), atol=1e-4)
    np.testing.assert_allclose(before.logprobs, _logprobs_of(load_tiny_model(model_dir), PROMPT + before.token_ids),
                               atol=1e-4)
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed[1:]] == [(adapter, server.served_model_name)]


@pytest.mark.parametrize("mode", ["reload", "keep"])
def test_a_request_in_flight_across_an_update_keeps_its_adapter_and_the_old_one_goes_after_it(
        start_embedded, model_dir, adapters, mode):
    server = start_embedded(model_dir, enable_lora=True, faults=FaultConfig(step_delay_s=0.02))

    async def main():
        async with InferenceClient(server.url, stream=True, lora=True) as client:
            await client.update_weights(adapters[0], 1, mode)
            first = client.adapter
            running = asyncio.ensure_future(client.complete(PROMPT, SamplingParams(max_tokens=40, seed=3)))
            while not client._live:
                await asyncio.sleep(0.01)
            await client.update_weights(adapters[1], 2, mode)
            still_loaded = set(server.lora.loaded)
            (across,) = await running
            (fresh,) = await client.complete(PROMPT, SamplingParams(max_tokens=4, seed=3))
            await client.update_weights(adapters[1], 2, mode)  # the next update unloads what nobody names
            return first, client.adapter, still_loaded, across, fresh, set(server.lora.loaded)

    first, second, still_loaded, across, fresh, finally_loaded = asyncio.run(main())
    assert across.policy_versions == [1] * 40  # exact, in either mode: the adapter never changed under it
    assert fresh.policy_versions == [2] * 4
    assert still_loaded == {first, second}  # the running request still named the first
    assert finally_loaded == {second}
    answer = httpx.post(f"{server.url}/v1/completions", json={"model": first, "prompt": PROMPT, "max_tokens": 1})
    assert answer.status_code == 404 and "does not exist" in answer.json()["error"]["message"]


def test_continue_aborts_and_continues_under_the_new_adapter(start_embedded, model_dir, adapters):
    server = start_embedded(model_dir, enable_lora=True, faults=FaultConfig(step_delay_s=0.02))

    async def main():
        async with InferenceClient(server.url, stream=True, lora=True) as client:
            await client.update_weights(adapters[0], 1, "continue")
            running = asyncio.ensure_future(client.complete(PROMPT, SamplingParams(max_tokens=40, seed=4)))
            while not any(c.token_ids for r in client._live for c in r.choices):
                await asyncio.sleep(0.01)
            await client.update_weights(adapters[1], 2, "continue")
            return await running

    (choice,) = asyncio.run(main())
    versions = choice.policy_versions
    assert len(versions) == 40 and versions[0] == 1 and versions[-1] == 2
    assert versions == sorted(versions) and set(versions) == {1, 2}


def test_an_adapter_that_does_not_fit_is_refused_and_the_server_keeps_serving(
        start_embedded, model_dir, adapters, tmp_path):
    server = start_embedded(model_dir, enable_lora=True)
    answer = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(model_dir)})
    assert answer.status_code == 400 and "whole weights" in answer.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters[0])})
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters[0])})
    assert ok.status_code == 200 and again.status_code == 400 and "already been loaded" in again.text
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    completion = httpx.post(f"{server.url}/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200


def test_a_server_without_lora_is_named_at_start_and_at_load(start_embedded, model_dir, adapters, tmp_path):
    server = start_embedded(model_dir)  # no --enable-lora: vLLM then has no such route

    async def main():
        async with InferenceClient(server.url, lora=True) as client:
            served = await client.serves_lora()
            with pytest.raises(InferenceError, match="serves no LoRA adapters .*--enable-lora"):
                await client.update_weights(adapters[0], 1, "keep")
            return served

    assert asyncio.run(main()) is False
    from beam_rl.job.preflight import check_servers

    config = config_from_dict({"run": {"dir": str(tmp_path)}, "inference": {"urls": [server.url]},
                               "envs": [{"name": "reverse_text", "group_size": 2}],
                               "batch": {"rollouts_per_step": 2}, "trainer": {"lora": {"rank": 4}}})
    with pytest.raises(ServersNotReadyError, match=f"{server.url} serves no LoRA adapters"):
        check_servers(job_parts(config), [server.url])
    lora_server = start_embedded(model_dir, enable_lora=True)
    check_servers(job_parts(config), [lora_server.url])  # one that serves them passes
