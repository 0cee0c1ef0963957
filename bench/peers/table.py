"""The side-by-side's table (markdown) from `bench/peers/results.json`: one row per system, workload and fleet
size, the same columns for every system; a cell it cannot fill says why.

    python -m bench.peers.table [bench/peers/results.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLUMNS = {  # key -> header; a Peer's CANNOT names a column (or a workload) by either
    "rollouts_per_s": "rollouts/s",
    "tokens_per_s": "tokens/s",
    "cpu_ms_per_rollout": "orchestrator CPU ms/rollout",
    "slots_occupied": "engine slots occupied",
    "tokens_thrown_away_at_updates": "tokens thrown away at updates",
    "s_back_to_90pct_after_update": "s back to 90% occupancy after an update",
    "tokens_lost_on_server_kill": "tokens lost when a server is killed",
    "rss_growth": "RSS growth",
}
FORMATS = {  # column -> how its number is written
    "rollouts_per_s": "{:.1f}",
    "tokens_per_s": "{:.0f}",
    "cpu_ms_per_rollout": "{:.1f}",
    "slots_occupied": "{:.0%}",
    "tokens_thrown_away_at_updates": "{:d}",
    "s_back_to_90pct_after_update": "{:.2f}",
    "tokens_lost_on_server_kill": "{:d}",
    "rss_growth": "{:+.1%}",
}


def cannot(reasons: dict[str, str], column: str) -> str | None:
    """Why a system cannot do `column` (or run the workload `column`): its CANNOT names it by key or header."""
    names = {column.lower(), COLUMNS.get(column, column).lower()}
    return next((why for key, why in reasons.items() if key.lower() in names), None)


def value(system: dict[str, Any], result: dict[str, Any], column: str) -> str:
    """The cell: its number, or why there is none (the system's CANNOT, the run's own reason, or what is missing)."""
    why = cannot(system.get("cannot", {}), column)
    if why:
        return f"cannot: {why}"
    if "cannot" in result:
        return f"cannot: {result['cannot']}"
    number = result.get(column)
    if number is not None:
        return FORMATS[column].format(number)
    return "n/a: " + _missing(result, column)


def _missing(result: dict[str, Any], column: str) -> str:
    """Why a column the system can do has no number in this run."""
    for part in (result, result.get("kill", {})):
        if f"{column}_why" in part:
            return part[f"{column}_why"]
    if column == "tokens_lost_on_server_kill" and "kill" not in result:
        return "one server: none left to go on after a kill"
    if column == "s_back_to_90pct_after_update":
        backs = result.get("s_back_per_update")
        if not backs:
            return "no update fell inside the steady window"
        return f"not back within the next update's pause ({backs})"
    if result.get("steady_window", 0) is None:
        failed = result.get("tokens_thrown_away_at_updates_why")
        return failed or "too few rollouts delivered for a steady window"
    return "not measured"


def render(report: dict[str, Any]) -> str:
    headers = COLUMNS
    lines = [
        "| system | workload | servers | " + " | ".join(headers.values()) + " |",
        "|---" * (3 + len(headers)) + "|",
    ]
    for system in report["systems"].values():
        if "unavailable" in system:
            cells = [f"cannot run here: {system['unavailable']}"] * len(headers)
            lines.append(f"| {system['name']} | all | all | " + " | ".join(cells) + " |")
            continue
        for key, result in system["cells"].items():
            workload, servers = key.split("/")
            cells = [value(system, result, column) for column in headers]
            lines.append(f"| {system['name']} | {workload} | {servers} | " + " | ".join(cells) + " |")
    versions = [f"{s['name']}: {s['version']}" for s in report["systems"].values() if "version" in s]
    commands = "\n".join(f"    {c}" for c in report.get("commands") or [report["command"]])
    return "\n".join(lines) + "\n\n" + "; ".join(versions) + f"\n\nfrom\n\n{commands}\n"


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several results files as one table: a later file's cell replaces an earlier one's (a rerun)."""
    merged: dict[str, Any] = {"systems": {}, "commands": [r["command"] for r in reports]}
    for report in reports:
        for key, system in report["systems"].items():
            into = merged["systems"].setdefault(key, {**system, "cells": {}})
            into.update({k: v for k, v in system.items() if k != "cells"})
            into["cells"].update(system.get("cells", {}))
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", type=Path, default=[Path("bench/peers/results.json")],
                        help="results files; a later one's cells replace an earlier one's")
    args = parser.parse_args(argv)
    print(render(merge([json.loads(path.read_text()) for path in args.results])), end="")


if __name__ == "__main__":
    main()
