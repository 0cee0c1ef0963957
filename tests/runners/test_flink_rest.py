"""The Flink REST client against a local HTTP server that behaves like a JobManager under load."""

import json
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runners.flink_rest import FlinkRest


class _SlowThenFine(BaseHTTPRequestHandler):
    stalls_left = 0
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        cls = type(self)
        if cls.stalls_left > 0:
            cls.stalls_left -= 1
            time.sleep(1.5)  # longer than the client's timeout below
        body = json.dumps({"jobs": [{"jid": "a", "name": "beam-rl", "start-time": 1, "state": "RUNNING"}]}).encode()
        self.send_response(cls.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowThenFine)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    _SlowThenFine.stalls_left, _SlowThenFine.status = 0, 200


def test_a_request_the_jobmanager_leaves_unanswered_is_retried(server):
    _SlowThenFine.stalls_left = 2
    rest = FlinkRest(f"127.0.0.1:{server.server_port}")
    assert rest.get("/jobs/overview", timeout_s=0.5)["jobs"][0]["jid"] == "a"
    assert _SlowThenFine.stalls_left == 0


def test_retries_run_out(server):
    _SlowThenFine.stalls_left = 5
    with pytest.raises(OSError):
        FlinkRest(f"127.0.0.1:{server.server_port}").get("/jobs/overview", timeout_s=0.3, attempts=2)


def test_an_error_status_is_not_retried(server):
    _SlowThenFine.status = 500
    with pytest.raises(urllib.error.HTTPError):
        FlinkRest(f"127.0.0.1:{server.server_port}").get("/jobs/overview", timeout_s=0.5)
