"""Where a benchmark's results go: a JSON file beside it, named on the console."""

from __future__ import annotations

import json
from typing import Any


def write_results(path: str, report: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"written to {path}")
