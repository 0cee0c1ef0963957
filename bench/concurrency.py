"""The in-flight cap, side by side: fixed caps against `dispatch.concurrency.mode = "goodput"` and `"kv"` on
simulated engines whose KV cache is bounded (they preempt when it fills, as vLLM V1 does), while the policy
moves on a clock. `python -m bench.concurrency [--size small|full] --out bench/concurrency.json`.

Each configuration drives the real dispatcher (beam_rl.components.dispatcher_thread, the one a shard runs)
against the same subprocess servers for the same wall time. Every `step_s` the servers load new weights
("keep": under running requests) and work past `max_off_policy_steps` is regenerated, as in a run. Reported:
trained tokens per second (completion tokens of rollouts that finished inside the bound), generated tokens
per second (the servers' own counter), the share thrown away, the servers' preemptions, and where the
controller settled. The servers are separate processes: their cost is not in the dispatcher's process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from beam_rl import components
from beam_rl.config import config_from_dict
from beam_rl.processes import stop_processes
from beam_rl.standin.launch import start_subprocess_server

SIZES: dict[str, dict[str, Any]] = {
    # 2 servers x 64 slots, each with room for 2,048 tokens of KV: some 20 sequences of this length mix.
    # One simulated second is 0.1 s; a policy step every 3 simulated seconds, about two median rollouts.
    "full": {"servers": 2, "max_num_seqs": 64, "kv_cache_tokens": 2048, "time_scale": 0.1, "seconds": 40.0,
             "step_s": 0.3, "ceiling": 256, "fixed": (8, 16, 32, 64, 256), "max_tokens": 256, "length_median": 64},
    "small": {"servers": 2, "max_num_seqs": 32, "kv_cache_tokens": 1024, "time_scale": 0.1, "seconds": 12.0,
              "step_s": 0.3, "ceiling": 128, "fixed": (8, 128), "max_tokens": 256, "length_median": 64},
}
BOUND = 1  # off_policy.max_off_policy_steps


def _server_counters(urls: list[str]) -> dict[str, float]:
    totals = {"generated": 0.0, "preemptions": 0.0}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == "vllm:generation_tokens_total":
                    totals["generated"] += sample.value
                elif sample.name == "vllm:num_preemptions_total":
                    totals["preemptions"] += sample.value
    return totals


def run_one(name: str, concurrency: dict[str, Any], urls: list[str], size: dict[str, Any], weights: Path) -> dict:
    config = config_from_dict({
        "envs": [{"name": "reverse_text", "group_size": 4}],
        "inference": {"urls": urls, "max_inflight": size["ceiling"], "max_tokens": size["max_tokens"],
                      "temperature": 1.0, "request_timeout_s": 600.0},
        "dispatch": {"concurrency": concurrency},
        "off_policy": {"max_off_policy_steps": BOUND},
    })
    envs = components.build_envs(config)
    schedule = components.build_schedule(config, envs)
    version = [0]
    thread = components.dispatcher_thread(config, urls, envs, lambda: version[0])
    before = _server_counters(urls)
    trained = rollouts = 0
    caps: list[int] = []
    position = 0
    started = time.monotonic()
    next_step = started + size["step_s"]
    try:
        while time.monotonic() - started < size["seconds"]:
            if thread.pending_groups() < 64:
                # Round after round of the rows, each group its own: ids that never repeat.
                rows = len(schedule)
                groups = [(p // rows, schedule.group(p % rows)) for p in range(position, position + 64)]
                thread.add_groups([replace(g, group_id=f"{g.group_id}/r{r}") for r, g in groups])
                position += 64
            for rollout in thread.poll(0.05):
                rollouts += 1
                oldest = rollout.token_version_min
                if rollout.ok and oldest is not None and version[0] - oldest <= BOUND:
                    trained += rollout.completion_tokens
            if time.monotonic() >= next_step:
                version[0] += 1
                thread.update_weights(weights, version[0], "keep")
                thread.handle_stale(version[0] - BOUND)
                next_step += size["step_s"]
            caps.append(thread.counters()["inflight_cap"])
        elapsed = time.monotonic() - started
        after = _server_counters(urls)
    finally:
        thread.close()
    generated = after["generated"] - before["generated"]
    settled = caps[len(caps) // 2:]
    result = {
        "trained_tokens_per_s": round(trained / elapsed, 1),
        "generated_tokens_per_s": round(generated / elapsed, 1),
        "thrown_away_share": round(1 - trained / generated, 3) if generated else None,
        "preemptions": int(after["preemptions"] - before["preemptions"]),
        "rollouts": rollouts,
        "cap_second_half_mean": round(sum(settled) / len(settled), 1) if settled else None,
        "policy_steps": version[0],
    }
    print(f"{name:>10}: {result}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    sim = ["--sim-time-scale", str(size["time_scale"]), "--sim-kv-cache-tokens", str(size["kv_cache_tokens"]),
           "--sim-length-median", str(size["length_median"]), "--served-model-name", "tiny"]
    procs, urls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"")  # the simulated engine checks the files exist
        try:
            for _ in range(size["servers"]):
                proc, url = start_subprocess_server(mode="simulated", max_num_seqs=size["max_num_seqs"],
                                                    extra_args=sim, die_with_parent=True)
                procs.append(proc)
                urls.append(url)
            configs = {f"fixed-{cap}": {"mode": "fixed"} for cap in size["fixed"]}
            configs.update({"goodput": {"mode": "goodput"}, "kv": {"mode": "kv"}})
            results = {}
            for name, concurrency in configs.items():
                if name.startswith("fixed-"):
                    cap = int(name.split("-")[1])
                    results[name] = run_one(name, concurrency, urls, {**size, "ceiling": cap}, weights)
                else:
                    results[name] = run_one(name, concurrency, urls, size, weights)
        finally:
            stop_processes(procs)
    best_fixed = max((r["trained_tokens_per_s"], n) for n, r in results.items() if n.startswith("fixed-"))
    out = {"size": args.size, "params": {k: v for k, v in size.items()}, "max_off_policy_steps": BOUND,
           "results": results, "best_fixed": best_fixed[1],
           "goodput_over_best_fixed": round(results["goodput"]["trained_tokens_per_s"] / best_fixed[0], 3),
           "goodput_over_ceiling": round(results["goodput"]["trained_tokens_per_s"]
                                         / results[f"fixed-{max(size['fixed'])}"]["trained_tokens_per_s"], 3)}
    print(json.dumps({k: out[k] for k in ("best_fixed", "goodput_over_best_fixed", "goodput_over_ceiling")}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
