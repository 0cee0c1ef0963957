"""The inference client's errors: typed, so that the dispatcher can tell a sick server from a bad request,
and so that a retry knows whether sending the same request again may succeed.

Their own module so that the client's parts (parsing, weight updates) raise them without importing the
client; `beam_rl.inference.client` exports them too, where plug-ins import them from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beam_rl.inference.types import Completion


class InferenceError(Exception):
    """Any failure talking to an inference server; the message names the server URL."""

    #: True when the failure says something about the server's health (it counts toward marking
    #: the server unhealthy) rather than about the request that was sent.
    server_fault: bool = False
    #: True when sending the same request again may succeed.
    retryable: bool = False

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url
        #: The choices of a failed completion as far as they came (tokens, logprobs, versions), set by
        #: `InferenceClient.complete`; None when nothing was asked or nothing can be kept.
        self.partial: list[Completion] | None = None


class InferenceHTTPError(InferenceError):
    """The server answered with a non-2xx status (5xx retryable, 4xx not)."""

    def __init__(self, message: str, url: str, status: int, body: str = "") -> None:
        super().__init__(message, url)
        self.status = status
        self.body = body
        # 503 is what a paused vLLM answers: it is transient, so retry it like any 5xx.
        self.retryable = self.server_fault = status >= 500


class InferenceAuthError(InferenceHTTPError):
    """HTTP 401 or 403: the server wants an API key this client does not have, or refuses the one it has.
    Never retried: the same key will not work the next time."""


class InferenceAborted(InferenceError):
    """The server ended the request with finish_reason "abort" without this client having paused it for a
    weight update (another client paused it, or it is shutting down): continued from its tokens."""

    retryable = True


class InferenceRetired(InferenceError):
    """The server left the fleet while the request ran (InferenceClient.retire): continued from its tokens
    on another server. Not a failure of the server: it does not count toward marking it unhealthy."""


class InferenceTimeout(InferenceError):
    server_fault = True
    retryable = True


class InferenceConnectionError(InferenceError):
    server_fault = True
    retryable = True

    def __init__(self, message: str, url: str, refused: bool = False) -> None:
        super().__init__(message, url)
        #: No connection could be made at all: the server is down rather than slow or sick, so the
        #: pool takes it out of selection at once instead of after several failures.
        self.refused = refused


class InferenceBadResponse(InferenceError):
    """A 2xx answer that is not what the protocol promises (bad JSON, missing or mismatched fields)."""


class InferenceCorruptResponse(InferenceBadResponse):
    """An answer no working server sends: token ids outside the model's vocabulary, or a body past
    `inference.max_response_mb`. It says the server is sick (the wrong model, a broken engine, or not a
    vLLM at all), so it counts against it and the rollout moves on with the tokens received before it."""

    server_fault = True


def http_error(method: str, url: str, status: int, body: bytes) -> InferenceHTTPError:
    """The error of a non-2xx answer: InferenceAuthError for 401 and 403, else InferenceHTTPError."""
    text = body.decode("utf-8", errors="replace")[:500]
    if status in (401, 403):
        return InferenceAuthError(
            f"{method} {url}: HTTP {status}: the server refuses this client's API key (or wants one): {text}",
            url,
            status,
            text,
        )
    return InferenceHTTPError(f"{method} {url}: HTTP {status}: {text}", url, status, text)
