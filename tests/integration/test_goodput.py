"""The goodput controller (beam_rl/dispatch/concurrency.py) at work rather than on its own: through the config in a
shard's dispatcher against a simulated engine, against the benchmark's kv-bound workload beside a sweep of fixed
caps, and on a model of the benchmark's measured curves (its rules on a modelled fleet:
tests/unit/dispatch/test_concurrency.py)."""

from __future__ import annotations

import pytest

from beam_rl.config import config_from_dict
from beam_rl.dispatch.concurrency import GoodputController
from tests.support.paths import REPO


def test_goodput_mode_from_the_config_slow_starts_the_shards_dispatcher(start_embedded):
    """dispatch.concurrency.mode = "goodput" through wiring.dispatcher_thread (what a shard runs): the
    cap starts at dispatch.concurrency.start and grows while the trained rate rises, against a simulated
    engine with slots to spare (how far it grows depends on when this machine's CPU, not the engine,
    stops the rate from rising)."""
    from beam_rl import wiring
    from beam_rl.standin.simulated import SimulatedParams

    server = start_embedded(None, mode="simulated", max_num_seqs=256, served_model_name="tiny",
                            simulated=SimulatedParams(time_scale=0.2, length_median=16))
    config = config_from_dict({"envs": [{"name": "reverse_text", "group_size": 4}],
                               "inference": {"urls": [server.url], "max_inflight": 64, "max_tokens": 32},
                               "dispatch": {"concurrency": {"mode": "goodput", "start": 8}}})
    envs = wiring.build_envs(config)
    schedule = wiring.build_schedule(config, envs)
    caps = []
    with wiring.dispatcher_thread(config, [server.url], envs, lambda: 0) as thread:
        thread.add_groups([schedule.group(p) for p in range(len(schedule))][:200])
        done = 0
        while done < 600:
            done += len(thread.poll(0.05))
            caps.append(thread.counters()["inflight_cap"])
    assert caps[0] == 8 and max(caps) >= 12, sorted(set(caps))  # grown by half at least once
    assert max(caps) <= 64
    print("caps seen:", sorted(set(caps)))


def test_goodput_against_the_simulated_engine_holds_a_cap_near_the_best_fixed_cap(tmp_path):
    """bench/throughput/concurrency.py --size small: one simulated server of 256 slots whose KV cache holds ~90 of the
    workload's sequences (beyond, they wait and go stale), a policy step every 1.2 s. Told nothing, goodput starts
    at a quarter of the ceiling (64); in its second half (slow start and descent behind it) it trains near the
    best of a sweep of fixed caps, holding a cap no lower than half the caps that train near the best and short
    of the ceiling. A group's permits count its running sequences, so the top of the curve is flat from the KV
    cache's edge to past twice it and which fixed cap comes out best is a draw (64 and 128 at 10.1k-10.3k and
    8.9k-10.0k tokens/s in three runs, 128 at 3.1k in a fourth). With the controller as it is, one run held 65
    and trained 1.18 of the best fixed cap in its second half; 0.75 leaves room for a shared machine."""
    from bench.throughput.concurrency import SIZES, run_workload, sweep

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    out = run_workload("kv_bound", SIZES["small"], ["fixed-64", "fixed-128", "fixed-256", "goodput"], weights)
    results = out["results"]
    fixed = sweep(results)
    best = max(fixed, key=fixed.__getitem__)
    if fixed[best] == 0:  # the premise: the engine runs in real time, which a CPU taken by other work stops
        pytest.skip(f"no fixed cap trained anything ({fixed}): the machine is too busy to run the simulated engine")
    goodput = results["goodput"]
    assert goodput["trained_tokens_per_s_second_half"] >= 0.75 * fixed[best], (fixed, goodput)
    near_best = [cap for cap, rate in fixed.items() if rate >= 0.9 * fixed[best]]  # one cap's runs vary by ~5%
    assert min(near_best) / 2 <= goodput["cap_second_half_mean"] <= 0.85 * 256, (fixed, goodput)


def test_goodput_on_a_model_of_the_benchmarks_measured_curves_stays_near_the_best_cap():
    """bench/throughput/concurrency_model.py: the benchmark's measured sweeps (bench/throughput/concurrency.json),
    each policy step's rate drawn with the spread of one real measurement. Over 180 s including its start, the
    controller trains 0.96 to 0.98 of the best cap there, 0.91 to 0.96 at the 10th percentile (seeded: the same every
    run); a controller that let one lucky measurement move it would wander off the peak."""
    import json

    from bench.throughput.concurrency import WORKLOADS, sweep
    from bench.throughput.concurrency_model import summary

    measured = json.loads((REPO / "bench" / "throughput" / "concurrency.json").read_text())["workloads"]
    for name, result in measured.items():
        curve = sweep(result["results"])
        mean, p10 = summary(lambda: GoodputController(result["ceiling"]), curve, WORKLOADS[name], 20, 0.15)
        assert mean >= 0.95 and p10 >= 0.9, (name, mean, p10)
