"""The benchmarks as smoke tests: `python -m bench.throughput.run --size small` completes on Prism and its JSON
holds every figure (never asserting timings: only that each number was measured), a few others at their smoke
sizes; and bench/'s own shape: no import circle, no private name imported from another file."""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys

from tests.support.paths import REPO as ROOT


def _bench_imports() -> list[tuple[str, str, list[str]]]:
    """(importer, imported module, names taken) for every import of a bench module inside bench/, at any
    depth (function-local imports included: they close a circle as soon as the function runs)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in (ROOT / "bench").rglob("*.py")}
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        importer = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
                for alias in node.names:  # `from a import b`: the submodule a.b when there is one
                    sub = f"{node.module}.{alias.name}"
                    found.append((importer, sub, []) if sub in modules else (importer, node.module, [alias.name]))
            elif isinstance(node, ast.Import):
                found += [(importer, a.name, []) for a in node.names if a.name.split(".")[0] == "bench"]
    return found


def test_bench_has_no_import_circle():
    edges: dict[str, set[str]] = {}
    for importer, module, _ in _bench_imports():
        if module != importer:
            edges.setdefault(importer, set()).add(module)
    try:
        list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"an import circle in bench/: {' -> '.join(reversed(e.args[1]))}") from None


def test_bench_imports_no_private_name_from_another_file():
    private = [f"{importer} takes {name} from {module}" for importer, module, names in _bench_imports()
               for name in names if name.startswith("_") and module != importer]
    assert private == [], "make what bench/ files share public (bench/common/)"


def test_small_benchmark_reports_every_figure(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, "-m", "bench.throughput.run", "--size", "small", "--runners", "direct",
                    "--out", str(out)],
                   cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    figures = result["figures"]
    from bench.throughput.run import FIGURES

    assert set(figures) == set(FIGURES)
    shares = figures["engine_utilization"]["full_share_mean"]
    assert set(shares) == {"beam_rl", "round_robin", "naive_batch"}
    assert all(0.0 <= s <= 1.0 for s in shares.values())
    policies = figures["engine_utilization"]["policies"]
    assert all(p["rollouts"] == figures["engine_utilization"]["rollouts_per_policy"] for p in policies.values())
    hit = figures["prefix_cache"]["hit_rate"]
    assert all(0.0 <= hit[p] <= 1.0 for p in ("beam_rl", "round_robin"))
    # Group affinity sends all of a group's attempts to one server: its hit rate cannot be lower
    # than spreading them (a property of the counts, not of timing).
    assert hit["beam_rl"] >= hit["round_robin"]
    pipe = figures["orchestration_overhead"]
    assert pipe["lower_bound_loop"]["rollouts"] > 0 and pipe["lower_bound_loop"]["cpu_ms_per_rollout"] > 0
    loops = pipe["lower_bound_loop_runs"]  # before and after the pipelines; the ratios take the best of them
    assert len(loops) == 2 and pipe["lower_bound_loop"]["rollouts_per_s"] == max(r["rollouts_per_s"] for r in loops)
    direct = pipe["runners"]["direct"]
    assert direct["rollouts"] == pipe["lower_bound_loop"]["rollouts"]
    # The steady-state CPU needs commits spread over the run; a small run may commit in a few bursts.
    assert direct["orchestrator_cpu_ms_per_rollout"] is None or direct["orchestrator_cpu_ms_per_rollout"] > 0
    assert direct["orchestrator_cpu_ms_per_rollout_whole_run"] > 0
    assert direct["throughput_ratio_vs_loop"] > 0 and direct["cpu_ratio_vs_loop"] > 0
    assert set(figures["commit_latency"]["direct"]) == {"p50", "p99", "max"}
    assert figures["commit_latency"]["direct"]["p50"] >= 0
    memory = figures["memory"]["direct"]
    assert len(memory["rss_mb"]) == 2 and memory["growth_after_warmup"] is not None
    sink = figures["sink"]
    assert sink["tokens"] > 0 and sink["tokens_per_s"] > 0 and sink["arrow_vs_plain"] > 0


def test_goodput_benchmark_accounts_for_every_generated_token(tmp_path):
    # bench/recovery/goodput.py at its smoke size: two servers, one killed every 1.5 s, weights published every step.
    out = tmp_path / "goodput.json"
    subprocess.run([sys.executable, "-m", "bench.recovery.goodput", "--size", "small", "--configs", "cancel,keep",
                    "--out", str(out)], cwd=ROOT, check=True, timeout=300, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    (results,) = json.loads(out.read_text())["results"].values()
    assert set(results) == {"cancel", "keep"}
    for name, r in results.items():
        assert r["steps"] == 5 and r["weight_updates"] >= 1, name  # steps may commit together
        # The window stats' fates count every generated token once (but clean ones no step took yet).
        assert sum(r["tokens_by_fate"].values()) == r["tokens_counted"] == r["tokens_generated"] - r["tokens_clean_not_cut"]
        assert r["accounting_adds_up"] and r["tokens_by_fate"]["trained"] > 0, name
        for key in ("goodput", "goodput_excluding_filters", "goodput_excluding_filters_and_shutdown"):
            assert 0.0 < r[key] <= 1.0, (name, key)
        assert r["goodput"] <= r["goodput_excluding_filters"] <= r["goodput_excluding_filters_and_shutdown"]
        assert r["engine_idle_s_per_update"] > 0
        for death in r["deaths"]:
            assert death["generated"] >= 0 and death["returned"] >= 0
    assert sum(r["server_deaths"] for r in results.values()) >= 1  # the chaos schedule ran during dispatch
    # The servers count each pause from their pause call to their resume call, inside the client's window.
    keep = results["keep"]
    assert 0 < keep["server_paused_s_per_update"] <= keep["engine_idle_s_per_update"]
    # Stalled: the part of those pauses the engine had sequences to step.
    assert 0 <= keep["engine_stalled_s_per_update"] <= keep["server_paused_s_per_update"]
    assert results["cancel"]["server_paused_s_per_update"] is None  # reload mode never pauses


def test_fleet_benchmark_times_a_join_against_the_load_alone():
    # bench/scale/fleet.py's join figure, one trial on the simulated engine (no timing asserted).
    from bench.scale.fleet import join_to_first_request

    result = join_to_first_request("simulated", trials=1)
    (trial,) = result["trials"]
    assert trial["load_alone_s"] > 0 and 0 < trial["join_s"] <= trial["join_to_first_request_s"]
    assert result["over_load_s_max"] == trial["over_load_s"]


def test_scale_benchmark_measures_one_shard_against_a_simulated_fleet():
    # bench/scale/scale.py at its smoke size: a fleet of 4 simulated servers in a process of its own, one shard
    # streaming and one not (figures present and sane, nothing timed).
    from bench.scale import scale

    result = scale.main(["--size", "small", "--parts", "sizes"])
    streaming, plain = result["sizes"]
    for row in (streaming, plain):
        assert row["servers"] == 4 and row["rollouts"] > 0 and row["tokens_returned"] > 0 and row["rollouts_failed"] == 0
        assert 0.0 < row["slots_occupied_min"] <= row["slots_occupied_mean"] <= 1.0
        assert row["process_cpu_s"] > 0 and row["process_cpu_ms_per_rollout"] > 0
        assert row["fleet_cpu_share"] > 0  # the fleet ran, in processes other than this one
    assert streaming["stream"] and streaming["route"] == "completions"
    # One event per engine step per request: a streamed rollout is at least one event.
    assert streaming["events"] >= streaming["rollouts"]
    assert streaming["process_cpu_us_per_event"] > 0
    assert not plain["stream"] and plain["route"] == "generate" and plain["events"] == 0


def test_packer_benchmark_commits_every_step_in_process_and_on_prism():
    # bench/scale/packer.py at 3 steps: the packer's and the writer's code alone, then the same two stages on
    # Prism (figures present, nothing timed).
    from bench.scale import packer

    result = packer.main(["--steps", "3", "--runners", "direct"])
    for where in ("in_process", "direct"):
        row = result["results"][where]
        assert row["steps"] == 3 and row["seconds"] > 0 and row["steps_per_s"] > 0 and row["rollouts_per_s"] > 0
