"""Runs docs/trainer-api.md's reader snippets (pyarrow, polars, duckdb, Hugging Face datasets) on a run
directory and says what each read, as plain values the tests compare with the run's commit records.

    python tests/support/read_run.py RUN_DIR [TOOL ...]    prints {"beam_rl": <where it was imported from>, TOOL: ...}

The tests run it in the project's venv (tests/unit/rundir/test_dataset.py) and in a fresh venv where beam-rl is
installed from a wheel (tests/ecosystem/test_wheel.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer-api.md"
SECTION = "## Reading a run with pyarrow, polars, duckdb or Hugging Face datasets"
DOC_RUN_DIR = "runs/my-run"


def snippets() -> dict[str, str]:
    """The section's code blocks by the tool each imports first (`pyarrow`, `polars`, `duckdb`, `datasets`)."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return {re.match(r"(?:from|import) (\w+)", block).group(1): block for block in blocks}


def _summary(tool: str, value: Any) -> Any:
    """What the snippet's last assignment read, as JSON values."""
    if tool == "pyarrow":  # ok rollouts per step
        steps = value.column("step").to_pylist()
        return {str(step): steps.count(step) for step in sorted(set(steps))}
    if tool == "polars":  # mean reward of ok rollouts per step
        return {str(step): mean for step, mean in value.collect().sort("step").iter_rows()}
    if tool == "duckdb":  # tokens per step
        return {str(step): int(tokens) for step, tokens in value}
    if tool == "datasets":  # samples and tokens per step
        per_step: dict[str, list[int]] = {}
        for step, seq_len in zip(value["step"], value["seq_len"]):
            counts = per_step.setdefault(str(step), [0, 0])
            counts[0] += 1
            counts[1] += seq_len
        return per_step
    raise ValueError(f"no summary for {tool!r}")


def read(run_dir: str | Path, tools: list[str]) -> dict[str, Any]:
    from beam_rl.rundir import RunDir

    code = snippets()
    read_by: dict[str, Any] = {}
    for tool in tools:
        block = code[tool].replace(DOC_RUN_DIR, str(run_dir))
        namespace: dict[str, Any] = {"RunDir": RunDir}
        exec(compile(block, f"{DOC.name}: {tool}", "exec"), namespace)
        target = re.match(r"(\w+) = ", block.strip().splitlines()[-1]).group(1)
        read_by[tool] = _summary(tool, namespace[target])
    return read_by


if __name__ == "__main__":
    import beam_rl

    print(json.dumps({"beam_rl": beam_rl.__file__, **read(sys.argv[1], sys.argv[2:])}))
