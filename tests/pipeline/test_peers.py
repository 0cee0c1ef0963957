"""The side-by-side harness (bench/peers, issue 51) as a smoke test: beam-rl on Prism and the plain loop, a few
seconds each against two simulated servers with weight updates and a killed server, and every column of the table
filled for each (a number, or the reason the system cannot), and each measured cell exported as a Benchmark Report
that llm-d's own package loads back with the same figures; no timing is asserted."""

from __future__ import annotations

import re
from pathlib import Path

from llmd_benchmark_report import import_benchmark_report

from bench.peers.beam_rl_peer import BeamRl
from bench.peers.compare import SEED, Schedule, compare
from bench.peers.plain_loop_peer import PlainLoop
from bench.peers.report import export
from bench.peers.table import COLUMNS, render
from bench.peers.workloads import WORKLOADS, prompts

NUMBER = re.compile(r"^[+-]?[0-9.]+%?$")
# Two seconds of the fleet's work, an update every second: updates fall inside the steady window.
SCHEDULE = Schedule(seconds=2.0, update_every_s=1.0, pause_s=0.2)


def _rows(table: str) -> dict[tuple[str, str], list[str]]:
    """(system, workload) -> its cells, from the markdown table."""
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0], cells[1]] = cells[3:]
    return rows


def test_every_column_is_filled_for_beam_rl_and_the_plain_loop(tmp_path: Path):
    # The plain loop on a workload it cannot run too: that row is its reason, with no run behind it.
    short, multi_turn = WORKLOADS["short"], WORKLOADS["multi_turn"]
    report = compare({"beam-rl-prism": BeamRl()}, [short], [2], SCHEDULE, "test")
    loop = compare({"plain-loop": PlainLoop()}, [short, multi_turn], [2], SCHEDULE, "test")
    report["systems"] |= loop["systems"]

    for key in ("beam-rl-prism", "plain-loop"):
        cell = report["systems"][key]["cells"]["short/2"]
        wanted = short.groups_for(2, SCHEDULE.seconds) * 4
        # Every rollout delivered in both runs, the second after a server was killed.
        assert (cell["rollouts_delivered"], cell["kill"]["rollouts_delivered"]) == (wanted, wanted), key
        assert cell["kill"]["rollouts_delivered_at_kill"] < wanted, key

    rows = _rows(render(report))
    assert set(rows) == {("beam-rl (prism)", "short"), ("plain loop", "short"), ("plain loop", "multi_turn")}
    for (name, workload), cells in rows.items():
        assert len(cells) == len(COLUMNS), (name, workload)
        for column, text in zip(COLUMNS, cells):
            assert NUMBER.match(text) or re.match(r"^(cannot|n/a): \S", text), (name, workload, column, text)
            assert "not measured" not in text, (name, workload, column, text)
    # beam-rl can do every column: each is a number but the recovery time, which needs an update inside its
    # steady window (a reason otherwise).
    beam_rl = dict(zip(COLUMNS, rows["beam-rl (prism)", "short"]))
    numbers = [c for column, c in beam_rl.items() if column != "s_back_to_90pct_after_update"]
    assert all(NUMBER.match(c) for c in numbers), numbers
    assert all(c.startswith("cannot: a completions loop") for c in rows["plain loop", "multi_turn"])

    # The Benchmark Reports: one a measured cell (the plain loop's multi_turn row has no run behind it).
    written = export(report, tmp_path)
    given = prompts("short", short.groups_for(2, SCHEDULE.seconds), SEED)  # what both systems were given
    assert sorted(p.name for p in written) == ["beam-rl-prism-short-2.yaml", "plain-loop-short-2.yaml"]
    for path, key in zip(sorted(written), ("beam-rl-prism", "plain-loop")):
        cell, loaded = report["systems"][key]["cells"]["short/2"], import_benchmark_report(str(path))
        aggregate = loaded.results.request_performance.aggregate
        assert aggregate.requests.total == cell["rollouts_delivered"]
        assert aggregate.requests.output_length.p50 == cell["output_length"]["p50"]
        assert aggregate.throughput.request_rate.mean == cell["rollouts_per_s"]
        assert loaded.scenario.load.standardized.input_seq_len.max == max(len(g["prompt_ids"]) for g in given)
        assert loaded.results.observability.beam_rl_peers["cpu_ms_per_rollout"] == cell["cpu_ms_per_rollout"]
