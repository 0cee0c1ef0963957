"""The side-by-side's results as llm-d Benchmark Reports (bench/peers/report.py): every measured cell of a recorded
results file becomes a report that the `llmd-benchmark-report` package loads back with the cell's figures, and a
figure its schema refuses is refused before anything is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from llmd_benchmark_report import import_benchmark_report
from pydantic import ValidationError

from bench.peers.report import benchmark_report, export

RESULTS = Path(__file__).resolve().parents[3] / "bench/peers/results-peers-9191698.json"


def test_every_measured_cell_loads_back_with_its_figures(tmp_path: Path) -> None:
    report = json.loads(RESULTS.read_text())
    cells = {
        (key, cell_key): cell
        for key, system in report["systems"].items()
        for cell_key, cell in system.get("cells", {}).items()
        if cell.get("steady_window")
    }
    written = export(report, tmp_path)
    assert len(written) == len(cells) == 8
    for (key, cell_key), cell in cells.items():
        loaded = import_benchmark_report(str(tmp_path / f"{key}-{cell_key.replace('/', '-')}.yaml"))
        aggregate = loaded.results.request_performance.aggregate
        assert aggregate.requests.total == cell["rollouts_delivered"]
        assert aggregate.throughput.request_rate.mean == cell["rollouts_per_s"]
        assert aggregate.throughput.output_token_rate.mean == cell["tokens_per_s"]
        assert (aggregate.requests.output_length.p50, aggregate.requests.output_length.max) == (
            cell["output_length"]["p50"],
            cell["output_length"]["max"],
        )
        engines = next(s for s in loaded.scenario.stack if s.standardized.kind == "inference_engine")
        assert engines.standardized.replicas == int(cell_key.split("/")[1])
        running = loaded.results.observability.components[0].aggregate.running_requests.mean
        assert running == pytest.approx(cell["slots_occupied"] * 16, abs=1e-3)
        extra = loaded.results.observability.beam_rl_peers
        assert extra["cpu_ms_per_rollout"] == cell["cpu_ms_per_rollout"]
        assert extra["tokens_lost_on_server_kill"] == cell.get("tokens_lost_on_server_kill")


def test_a_figure_the_format_refuses_is_refused(tmp_path: Path) -> None:
    report = copy.deepcopy(json.loads(RESULTS.read_text()))
    report["systems"]["beam-rl-prism"]["cells"]["short/2"]["rollouts_delivered"] = -1
    with pytest.raises(ValidationError, match="total"):
        benchmark_report(report, "beam-rl-prism", "short/2")
