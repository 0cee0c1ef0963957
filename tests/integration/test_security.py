"""Secured embedded servers, as vLLM 0.32 secures its own: an API key on the /v1 routes (401 with
vLLM's body otherwise, never printed) and https with a self-signed certificate."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from beam_rl.standin.server import EmbeddedServer, start_subprocess_server

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-3f9c1d"
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed():
    with EmbeddedServer(mode="instant", api_key=KEY) as server:
        yield server


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}])
def test_v1_routes_refuse_a_missing_or_wrong_key(keyed, headers):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("POST", "/inference/v1/generate")):
        response = httpx.request(method, keyed.url + path, json=COMPLETION, headers=headers, timeout=10)
        assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}, path


def test_the_right_key_is_served_and_health_and_metrics_stay_open(keyed):
    response = httpx.post(keyed.url + "/v1/completions", json=COMPLETION, headers=bearer(KEY), timeout=10)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(keyed.url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    # Routes that only read stay open, as vLLM's do (tests/unit/standin/test_server_auth.py: the control routes do not).
    for path in ("/health", "/metrics", "/is_paused", "/weight_info"):
        assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path


def test_several_keys_are_each_accepted():
    with EmbeddedServer(mode="instant", api_key=["first", "second"]) as server:
        for key, status in (("first", 200), ("second", 200), ("third", 401)):
            assert httpx.get(server.url + "/v1/models", headers=bearer(key)).status_code == status


def test_a_subprocess_server_never_prints_its_key(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "beam_rl.standin.server", "--port", "0", "--mode", "instant", "--api-key", KEY],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _ready_url(log, proc)
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer("nope")).status_code == 401
        bad = httpx.post(url + "/v1/completions", json={"prompt": []}, headers=bearer(KEY))
        assert bad.status_code == 400 and KEY not in bad.text
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert text.startswith("READY ") and KEY not in text


def test_the_key_can_come_from_vllm_api_key():
    env = {**os.environ, "VLLM_API_KEY": KEY}
    proc, url = start_subprocess_server(mode="instant", env=env, ready_timeout_s=60)
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=bearer(KEY)).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ready_url(log, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The URL of the `READY <url>` line once the server has written it whole."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        first, newline, _ = log.read_text().partition("\n")
        if first.startswith("READY ") and newline:
            return first.split(" ", 1)[1]
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError("server never printed READY")


# -- https -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files."""
    directory = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


def test_https_with_a_self_signed_certificate(self_signed):
    certfile, keyfile = self_signed
    with EmbeddedServer(mode="instant", ssl_certfile=certfile, ssl_keyfile=keyfile, api_key=KEY) as server:
        assert server.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(certfile))
        response = httpx.post(server.url + "/v1/completions", json=COMPLETION, headers=bearer(KEY), verify=trusting)
        assert response.status_code == 200 and len(response.json()["choices"]) == 1
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.url + "/health")  # the system's CAs do not know a self-signed certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)  # no plain http


def test_https_subprocess_server_from_vllm_flag_names(self_signed):
    certfile, keyfile = self_signed
    proc, url = start_subprocess_server(
        mode="instant", extra_args=("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)), ready_timeout_s=60)
    try:
        assert url.startswith("https://")
        assert httpx.get(url + "/health", verify=ssl.create_default_context(cafile=str(certfile))).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
