"""API keys and TLS for the embedded server, as vLLM 0.32 does them: `--api-key` guards the
`/v1`, `/v2`, `/inference` and `/cohere` routes (health, metrics and control routes stay open), and
`--ssl-keyfile/--ssl-certfile` serve https.

Keys are kept only as SHA-256 digests, so the server can never print or log one.
"""

from __future__ import annotations

import hashlib
import secrets
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_key_middleware(keys: Sequence[str]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Answers 401 `{"error": "Unauthorized"}` (vLLM's body) unless `Authorization: Bearer <one of keys>`."""
    digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def authorized(header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        match = False
        for expected in digests:  # compare with every key, in constant time
            match |= secrets.compare_digest(digest, expected)
        return match

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        guarded = request.path.startswith(GUARDED_PREFIXES) and request.method != "OPTIONS"
        if guarded and not authorized(request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return middleware


def server_ssl_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A TLS server context from a PEM certificate (chain) and its private key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context
