"""The side-by-side's results in llm-d's Benchmark Report format (v0.2.1, the `llmd-benchmark-report` package):
one report per system, workload and fleet size, validated by that package's own schema before it is written.

    python -m bench.peers.report bench/peers/results.json --out-dir bench/peers/reports

What the format has a field for goes there: the rollouts delivered and their completion lengths (in results
measured since the harness records them), rollouts/s (`request_rate`, a rollout being one request's answer),
tokens/s, the prompts' lengths, the fleet (a
`inference_engine` component, its replicas) and the orchestrator (a `generic` component), the engines' mean running
requests (their slot occupancy x slots a server). The columns it has none for (CPU per rollout, tokens thrown away
at updates, seconds back after an update, tokens lost on a kill, RSS growth) go under
`results.observability.beam_rl_peers`, a key the format leaves open for metrics it has not formalised.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

from llmd_benchmark_report import BenchmarkReportV02

from bench.peers.compare import length_stats
from bench.peers.job import SLOTS_PER_SERVER
from bench.peers.table import COLUMNS
from bench.peers.workloads import WORKLOADS, prompts

NAMESPACE = uuid.UUID("6f0cf0c9-3d55-4b8e-9a0e-2d1f58bd3d0c")  # this harness's reports: ids from their contents
ENGINE_LABEL = "simulated-vllm"
OPEN_COLUMNS = [c for c in COLUMNS if c not in ("rollouts_per_s", "tokens_per_s", "slots_occupied")]


def _cfg_id(config: Any) -> str:
    return hashlib.md5(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _stats(units: str, values: dict[str, float]) -> dict[str, Any]:
    return {"units": units, **values}


def _time(window: list[float]) -> dict[str, str]:
    start, end = (datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in window)
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "duration": f"PT{end.timestamp() - start.timestamp():.3f}S",
    }


def _stack(key: str, system: dict[str, Any], servers: int, server_args: list[str]) -> list[dict[str, Any]]:
    orchestrator = {"cannot": system.get("cannot", {})}
    engine_args = dict(zip(server_args[::2], server_args[1::2]))
    return [
        {
            "metadata": {
                "label": key,
                "cfg_id": _cfg_id(orchestrator),
                "description": "the rollout orchestrator measured: its process tree, the servers excluded",
            },
            "standardized": {
                "kind": "generic",
                "tool": system["name"],
                "tool_version": system["version"],
                "role": "rollout_orchestrator",
            },
            "native": {"config": orchestrator},
        },
        {
            "metadata": {
                "label": ENGINE_LABEL,
                "cfg_id": _cfg_id(engine_args),
                "description": "beam-rl's simulated vLLM engines (beam_rl/standin/simulated.py), no accelerator",
            },
            "standardized": {
                "kind": "inference_engine",
                "tool": "beam-rl simulated engine",
                "tool_version": "0",
                "role": "replica",
                "replicas": servers,
                "model": {"name": "tiny"},
                "accelerator": {"model": "none (simulated)", "count": 0, "parallelism": {}},
            },
            "native": {"args": engine_args},
        },
    ]


@functools.cache
def _prompt_lengths(workload_name: str, groups: int, seed: int) -> dict[str, float]:
    """The prompts are a function of the workload, the run's size and the seed: every system of a results file
    had these, so they are made once for all of its cells."""
    stats = length_stats([len(g["prompt_ids"]) for g in prompts(workload_name, groups, seed)])
    assert stats is not None
    return stats


def _load(report: dict[str, Any], workload_name: str, servers: int, cell: dict[str, Any]) -> dict[str, Any]:
    workload = WORKLOADS[workload_name]
    prompt = _prompt_lengths(workload_name, workload.groups_for(servers, report["schedule"]["seconds"]), report["seed"])
    standardized: dict[str, Any] = {
        "tool": "bench.peers.compare",
        "tool_version": "1",
        "source": "sampled" if workload.turns > 1 else "random",
        "input_seq_len": {
            "distribution": "other",
            "value": prompt["mean"],
            "min": int(prompt["min"]),
            "max": int(prompt["max"]),
        },
        "output_seq_len": {"distribution": "other", "value": workload.length_median, "max": workload.max_tokens},
        "concurrency": servers * SLOTS_PER_SERVER,
    }
    if workload.turns > 1:
        standardized["multi_turn"] = {"enabled": True, "max_turns": {"distribution": "fixed", "value": workload.turns}}
    native = {
        "workload": report["workloads"][workload_name],
        "schedule": report["schedule"],
        "group_size": report["group_size"],
        "seed": report["seed"],
        "command": report["command"],
    }
    return {
        "metadata": {"cfg_id": _cfg_id(native), "description": f"`{workload_name}`: {servers} servers"},
        "standardized": standardized,
        "native": {"config": native},
    }


def benchmark_report(report: dict[str, Any], key: str, cell_key: str) -> BenchmarkReportV02:
    """One system's cell of a results file as a Benchmark Report (raises if the format's schema refuses it)."""
    system = report["systems"][key]
    cell = system["cells"][cell_key]
    workload_name, servers_text = cell_key.split("/")
    servers = int(servers_text)
    requests: dict[str, Any] = {"total": cell["rollouts_delivered"]}
    if cell.get("output_length"):
        requests["output_length"] = _stats("count", cell["output_length"])
    data = {
        "version": "0.2.1",
        "run": {
            "uid": uuid.uuid5(NAMESPACE, f"{report['command']}|{report['wall_s']}|{key}|{cell_key}").hex,
            "eid": uuid.uuid5(NAMESPACE, report["command"]).hex,
            "time": _time(cell["steady_window"]),
            "description": f"{system['name']} on `{workload_name}`, {servers} simulated servers (bench.peers)",
            "keywords": ["beam-rl", "rollout orchestration", workload_name, key],
        },
        "scenario": {
            "stack": _stack(key, system, servers, WORKLOADS[workload_name].server_args()),
            "load": _load(report, workload_name, servers, cell),
        },
        "results": {
            "request_performance": {
                "aggregate": {
                    "requests": requests,
                    "throughput": {
                        "request_rate": _stats("queries/s", {"mean": cell["rollouts_per_s"]}),
                        "output_token_rate": _stats("tokens/s", {"mean": cell["tokens_per_s"]}),
                    },
                }
            },
            "observability": {
                "components": [
                    {
                        "component_label": ENGINE_LABEL,
                        "aggregate": {
                            "running_requests": _stats(
                                "count", {"mean": round(cell["slots_occupied"] * SLOTS_PER_SERVER, 3)}
                            )
                        },
                    }
                ],
                "beam_rl_peers": {c: cell.get(c) for c in OPEN_COLUMNS},
            },
        },
    }
    return BenchmarkReportV02(**data)


def export(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every measured cell of a results file as `<system>-<workload>-<servers>.yaml` in `out_dir`; a cell with no
    steady window (a run that failed, a workload the system cannot do) has no report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, system in report["systems"].items():
        for cell_key, cell in system.get("cells", {}).items():
            if not cell.get("steady_window"):
                continue
            path = out_dir / f"{key}-{cell_key.replace('/', '-')}.yaml"
            benchmark_report(report, key, cell_key).export_yaml(path)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results file of bench.peers.compare")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/peers/reports"))
    args = parser.parse_args(argv)
    for path in export(json.loads(args.results.read_text()), args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
