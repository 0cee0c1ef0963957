"""The slice of Flink's REST API beam-rl uses: find a job by name, follow its state, cancel it, and read
its checkpoints and metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

TERMINAL = ("FINISHED", "FAILED", "CANCELED")


class FlinkRest:
    def __init__(self, master: str) -> None:
        self.master = master if master.startswith(("http://", "https://")) else f"http://{master}"

    def get(self, path: str, timeout_s: float = 10.0, attempts: int = 4) -> Any:
        """GET `path` as JSON. A JobManager under load (a checkpoint, a failover) can leave a request
        unanswered for seconds, so timeouts and refused connections are retried with backoff; an HTTP
        error status is not."""
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(f"{self.master}{path}", timeout=timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError:
                raise
            except (OSError, urllib.error.URLError):
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * 2**attempt)

    def reachable(self) -> bool:
        try:
            self.get("/overview", timeout_s=5.0, attempts=1)
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
