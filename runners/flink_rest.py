"""The slice of Flink's REST API beam-rl uses: find a job by name, follow its state, cancel it, and read
its checkpoints and metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

TERMINAL = ("FINISHED", "FAILED", "CANCELED")


class FlinkRest:
    def __init__(self, master: str) -> None:
        self.master = master if master.startswith(("http://", "https://")) else f"http://{master}"

    def get(self, path: str, timeout_s: float = 5.0) -> Any:
        with urllib.request.urlopen(f"{self.master}{path}", timeout=timeout_s) as response:
            return json.loads(response.read())

    def reachable(self) -> bool:
        try:
            self.get("/overview")
            return True
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the cluster knows: id (`jid`), `name`, `state`, times."""
        return self.get("/jobs/overview")["jobs"]

    def job_named(self, name: str) -> dict[str, Any] | None:
        """The newest job called `name`."""
        matching = [j for j in self.jobs() if j["name"] == name]
        return max(matching, key=lambda j: j["start-time"], default=None)

    def state(self, job_id: str) -> str:
        return self.get(f"/jobs/{job_id}")["state"]

    def cancel(self, job_id: str) -> None:
        request = urllib.request.Request(f"{self.master}/jobs/{job_id}?mode=cancel", method="PATCH")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/jobs/{job_id}/checkpoints")

    def metric(self, job_id: str, name: str) -> float | None:
        values = self.get(f"/jobs/{job_id}/metrics?get={name}")
        return float(values[0]["value"]) if values else None
