"""The simulated vLLM engine: continuous batching under max_num_seqs, prefix cache, long-tailed
lengths, vLLM metric names, over real loopback HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.standin.generator import GenerationParams, WeightsError
from beam_rl.standin.server import EmbeddedServer
from beam_rl.standin.simulated import BlockPrefixCache, SimulatedEngine, SimulatedParams

FAST = SimulatedParams(decode_base_s=0.001, decode_s_per_seq=1e-5, prefill_s_per_token=0.0, length_median=8)


def _engine(max_num_seqs=4, params=FAST):
    return SimulatedEngine(params, max_num_seqs, vocab_size=100, special_ids={0, 1}, eos_token_ids=frozenset({1}))


async def _complete(engine: SimulatedEngine, params: GenerationParams):
    """The request's final choices (the last thing the backend's generate yields)."""
    async for choices in engine.generate(params):
        pass
    return choices


def test_prefix_cache_hits_full_blocks_of_a_repeated_prefix_only():
    cache = BlockPrefixCache(capacity_blocks=8, block_size=4)
    prompt = tuple(range(10, 20))  # two full blocks + 2 tokens
    assert cache.lookup(prompt) == 10
    assert cache.lookup(prompt) == 2  # the partial last block is never cached
    assert cache.lookup((10, 11, 12, 99) + prompt[4:]) == 10  # first block differs: chain breaks
    assert (cache.queries, cache.hits) == (30, 8)
    cache.reset()
    assert cache.lookup(prompt) == 10


def test_batch_never_exceeds_max_num_seqs_and_seeded_requests_repeat():
    async def main():
        engine = _engine(max_num_seqs=4)
        params = [GenerationParams(prompt_ids=(5, 6, 7), n=3, max_tokens=32, seed=s) for s in range(4)]
        first = await asyncio.gather(*(_complete(engine, p) for p in params))
        again = await _complete(engine, params[2])
        await engine.aclose()
        return engine, first, again

    engine, first, again = asyncio.run(main())
    assert engine.max_running == 4
    assert max(engine.trace.running) == 4
    assert [c.token_ids for c in again] == [c.token_ids for c in first[2]]
    for choices in first:
        for c in choices:
            assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= 32
            assert c.finish_reason == ("length" if len(c.token_ids) == 32 else "stop")
            assert c.finish_reason == "length" or c.token_ids[-1] == 1


def test_lengths_are_long_tailed_and_clipped():
    engine = _engine(params=SimulatedParams(length_median=20, length_sigma=1.0))
    params = GenerationParams(prompt_ids=(5,), max_tokens=200, seed=None)
    lengths = sorted(engine._draw_length(params, key, 0) for key in range(2000))
    median, p99 = lengths[1000], lengths[1980]
    assert 15 <= median <= 25 and p99 >= 4 * median and lengths[-1] <= 200


def test_step_time_grows_with_the_running_batch():
    p = SimulatedParams(decode_base_s=0.01, decode_s_per_seq=1e-4, prefill_s_per_token=1e-5, time_scale=2.0)
    assert p.step_s(256, 0) > p.step_s(1, 0)
    assert p.step_s(10, 1000) == pytest.approx(2 * (0.01 + 10e-4 + 1000 * 1e-5))


def test_server_in_simulated_mode_answers_completions_and_reports_vllm_metrics():
    with EmbeddedServer(mode="simulated", max_num_seqs=8, simulated=FAST) as server:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                body = {"prompt": list(range(5, 45)), "n": 4, "max_tokens": 16, "logprobs": 1,
                        "return_token_ids": True, "seed": 3}
                responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))
                metrics = (await client.get("/metrics")).text
                trace = (await client.get("/simulated/trace", params={"since": 0})).json()
                reset = await client.post("/reset_prefix_cache")
                return responses, metrics, trace, reset

        responses, metrics, trace, reset = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 4 and reset.status_code == 200
    choice = responses[0].json()["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["vllm:prefix_cache_queries_total"] == 160
    assert values["vllm:prefix_cache_hits_total"] == 3 * 32  # 2 full blocks of 16, hit by 3 of 4 requests
    assert values["beam_rl:max_concurrent_requests"] == 8  # 16 sequences queued, 8 slots
    assert values["vllm:num_requests_running"] == 0
    assert trace["max_num_seqs"] == 8 and max(trace["running"]) == 8


def test_cancelled_request_frees_its_slots():
    async def main():
        engine = _engine(max_num_seqs=2, params=SimulatedParams(decode_base_s=0.01, length_median=1000))
        slow = asyncio.ensure_future(_complete(engine, GenerationParams(prompt_ids=(5,), n=2, max_tokens=1000, seed=1)))
        await asyncio.sleep(0.05)
        assert engine.running == 2
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        quick = await asyncio.wait_for(_complete(engine, GenerationParams(prompt_ids=(5,), n=2, max_tokens=3, seed=2)), 5)
        await engine.aclose()
        return quick

    assert all(len(c.token_ids) <= 3 for c in asyncio.run(main()))


def test_each_token_carries_the_weights_version_of_its_step(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")  # a simulated engine only checks the files exist

    async def main():
        engine = _engine(params=SimulatedParams(decode_base_s=0.005, decode_s_per_seq=0.0, length_median=1000))
        params = GenerationParams(prompt_ids=(5,), max_tokens=30, seed=1, ignore_eos=True)
        reloaded_after: list[int] = []  # tokens the request had when each reload returned
        async for choices in engine.generate(params, progress=True):
            sampled = len(choices[0].token_ids)
            if sampled >= 5 * (len(reloaded_after) + 1) and len(reloaded_after) < 2:
                await engine.load_weights(str(tmp_path))
                reloaded_after.append(engine.generation_tokens)
        await engine.aclose()
        return choices[0].weight_versions, reloaded_after, engine.weights.loads

    versions, reloaded_after, final = asyncio.run(main())
    first, second = versions.count(0), versions.count(1)
    assert final == 2 and len(versions) == 30
    assert versions == [0] * first + [1] * second + [2] * (30 - first - second)
    # A reload lands between two steps: tokens sampled before it returned kept the older version.
    assert first == reloaded_after[0] and first + second == reloaded_after[1]
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        asyncio.run(_engine().load_weights(str(tmp_path / "nowhere")))


def test_a_pause_stalls_the_engine_only_while_it_holds_work_back():
    from beam_rl.standin.backend import PauseGate, PauseState

    async def main():
        gate = PauseGate()
        engine = SimulatedEngine(SimulatedParams(decode_base_s=0.002, decode_s_per_seq=0.0, length_median=1000),
                                 4, vocab_size=100, special_ids={0, 1}, eos_token_ids=frozenset({1}), gate=gate)
        # Paused with nothing to run: no engine time lost.
        gate.set(PauseState.PAUSED_ALL)
        await asyncio.sleep(0.2)
        gate.set(PauseState.UNPAUSED)
        idle_pause = engine.stalled_seconds
        running = asyncio.ensure_future(_complete(engine, GenerationParams(prompt_ids=(5,), max_tokens=900, seed=1)))
        await asyncio.sleep(0.05)
        # "keep" freezes the running sequence: all of the pause is lost.
        gate.set(PauseState.PAUSED_ALL)
        await engine.quiesce()
        await asyncio.sleep(0.3)
        gate.set(PauseState.UNPAUSED)
        frozen = engine.stalled_seconds - idle_pause
        # A pause that only holds new requests back while the running one steps costs nothing...
        gate.set(PauseState.PAUSED_NEW)
        await asyncio.sleep(0.2)
        stepping = engine.stalled_seconds - idle_pause - frozen
        # ...until it aborts what runs ("continue"): those sequences return only once the pause is over.
        await engine.abort_all()
        await asyncio.gather(running)
        await asyncio.sleep(0.2)
        gate.set(PauseState.UNPAUSED)
        # Resumed, the engine has nothing to run until what the pause aborted comes back: stalled too.
        await asyncio.sleep(0.1)
        await _complete(engine, GenerationParams(prompt_ids=(5,), max_tokens=3, seed=3))
        await asyncio.sleep(0.05)  # resumed with nothing to run and nothing owed: no stall
        aborted = engine.stalled_seconds - idle_pause - frozen - stepping
        # A request that arrives during a pause waits behind the gate.
        gate.set(PauseState.PAUSED_NEW)
        queued = asyncio.ensure_future(_complete(engine, GenerationParams(prompt_ids=(5,), max_tokens=3, seed=2)))
        await asyncio.sleep(0.2)
        gate.set(PauseState.UNPAUSED)
        await asyncio.wait_for(queued, 5)
        held = engine.stalled_seconds - idle_pause - frozen - stepping - aborted
        await engine.aclose()
        return idle_pause, frozen, stepping, aborted, held

    idle_pause, frozen, stepping, aborted, held = asyncio.run(main())
    assert idle_pause == 0.0 and stepping < 0.01, stepping
    assert 0.25 <= frozen <= 0.5, frozen
    assert 0.25 <= aborted <= 0.4, aborted
    assert 0.15 <= held <= 0.3, held


def test_a_full_kv_cache_preempts_the_newest_sequence_which_resumes_with_its_tokens(tmp_path):
    """kv_cache_tokens bounds the batch: sequences are preempted (recompute) when decoding fills it, come
    back with the tokens they had, and end exactly as on an engine with room for all; each token keeps the
    weights version of the step that sampled it, across a preemption and a reload."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    bounded = SimulatedParams(decode_base_s=0.001, decode_s_per_seq=0.0, length_median=40, kv_cache_tokens=256)
    unbounded = SimulatedParams(decode_base_s=0.001, decode_s_per_seq=0.0, length_median=40)
    params = [GenerationParams(prompt_ids=tuple(range(2, 34)), n=1, max_tokens=64, seed=s) for s in range(8)]

    async def run(engine_params, reload_at_step=None):
        engine = _engine(max_num_seqs=8, params=engine_params)
        usage: list[float] = []

        async def watch():
            while True:
                usage.append(engine.kv_cache_usage())
                if reload_at_step is not None and engine.steps >= reload_at_step and engine.weights.loads == 0:
                    await engine.load_weights(str(tmp_path))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        done = await asyncio.gather(*(_complete(engine, p) for p in params))
        watcher.cancel()
        await engine.aclose()
        return engine, done, usage

    engine, done, usage = asyncio.run(run(bounded, reload_at_step=20))
    roomy, expected, _ = asyncio.run(run(unbounded))
    assert engine.preemptions > 0 and roomy.preemptions == 0
    assert max(usage) <= 1.0
    assert [c[0].token_ids for c in done] == [c[0].token_ids for c in expected]
    assert engine.steps > roomy.steps  # waiting for room and recomputing cost engine steps
    for choices in done:
        versions = choices[0].weight_versions
        assert len(versions) == len(choices[0].token_ids) and versions == sorted(versions)
    assert any(1 in c[0].weight_versions for c in done)
