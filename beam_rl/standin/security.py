"""API keys and TLS for the embedded server: `--api-key` and `--ssl-keyfile/--ssl-certfile` as vLLM 0.32
takes them, with a stricter rule for which routes the key guards (`needs_key`).

vLLM's key guards only its `/v1`, `/v2`, `/inference` and `/cohere` routes: its control routes (`/pause`,
`/collective_rpc`, ...) answer anyone who can reach the port. Here a key guards those prefixes and every
request that may change the server's state, i.e. every method but GET and HEAD (pause, resume, faults,
weight loads and labels, LoRA adapters, the prefix cache; `/tokenize` too, which only reads). What stays
open is what only reads: `/health`, `/metrics`, `/is_paused`, `/weight_info`, `GET /faults` and
`/simulated/trace`, as vLLM leaves them; and OPTIONS, as vLLM does (CORS preflights carry no key).

Keys are kept only as SHA-256 digests, so the server can never print or log one.
"""

from __future__ import annotations

import hashlib
import secrets
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def needs_key(request: web.Request) -> bool:
    """Whether a keyed server refuses `request` without its key (the module docstring says which)."""
    if request.method == "OPTIONS":
        return False
    return request.path.startswith(GUARDED_PREFIXES) or request.method not in READ_ONLY_METHODS


def api_key_middleware(keys: Sequence[str]) -> Middleware:
    """Answers 401 `{"error": "Unauthorized"}` (vLLM's body) to a request `needs_key` guards, unless it carries
    `Authorization: Bearer <one of keys>`."""
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
        if needs_key(request) and not authorized(request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return middleware


def server_ssl_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A TLS server context from a PEM certificate (chain) and its private key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context
