"""The inference proxy: an OpenAI-compatible endpoint on loopback through which a program the environment
runs (a black-box agent, an agent framework's harness) samples from the policy, so that every model call
still goes through the dispatcher's client for its rollout.

An `Episode` is one rollout's session; `InferenceProxy.serve(episode)` gives its endpoint: a base URL
(`http://127.0.0.1:PORT/rollouts/KEY/v1`), or the shared `/v1` with the key in the `X-Beam-RL-Rollout`
header, so that one client serves many rollouts; both are valid while the episode runs. The key names the
session; every call must also carry the session's secret, handed only to the program that runs it, as its
API key (`Authorization: Bearer`) or in `X-Beam-RL-Secret`: without it a call is answered 401, with another
session's 403, so no program can add turns to (or read the replies of) another's rollout. Each
call becomes one turn: it is sampled by the rollout's own `CompletionClient` (group affinity, permits,
per-token policy versions, update modes, failover with the streamed tokens, goodput accounting) and
recorded token for token. What the program sends back must extend the conversation: the trained context
is the exact ids the server sampled plus the chat template's ids of the messages the program added
(masked out of the loss), never its text re-tokenized.

Routes under the base URL: `POST /chat/completions` (messages, tools; `stream` answered as one event),
`POST /completions` (a prompt of token ids or of text), `GET /models` (the policy, with the rollout's
context window as vLLM's `max_model_len`) and vLLM's token-in route at
`/rollouts/KEY/inference/v1/generate`; `POST /responses` (the Responses API) is refused with a 400 that
says to use chat completions. The run's sampling decides temperature and seeds; a call's `max_tokens` can
only shorten the turn's budget. One proxy serves every episode of an event loop (a
dispatch worker's dispatcher), started with the first episode. It binds 127.0.0.1 unless told another
address (`host`), for a harness on another host or in a container, which is handed `advertise` (the name
that host reaches this one by) in its URLs; only the unguessable secrets guard it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web

from beam_rl.envs.base import CompletionClient, DatasetEnvironment, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.loop_local import loop_local
from beam_rl.envs.multi_turn import FollowUps
from beam_rl.envs.tools import ToolCall, parse_tool_calls
from beam_rl.inference.types import Completion
from beam_rl.listeners import LOOPBACK, warn_if_open
from beam_rl.types import Turn

MODEL_NAME = "policy"  # what /models lists; the model a call names is not read


class ProxyError(Exception):
    """A call the proxy refuses or cannot answer: `status` and `message` go back to the program."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Episode:
    """One rollout's calls, as turns: the first call's prompt is the rollout's prompt, and each later
    call must extend the context so far (the prompt, every completion and every reply before it)."""

    def __init__(
        self, env: DatasetEnvironment, client: CompletionClient, sampling: SamplingParams, follow_ups: FollowUps
    ) -> None:
        self.env = env
        self.client = client
        self.sampling = sampling
        self.follow_ups = follow_ups
        self.prompt_ids: list[int] | None = None
        self.context: list[int] = []
        self.turns: list[Turn] = []
        self.failure: BaseException | None = None  # what the rollout's client raised: the rollout's error
        self._route: str | None = None
        self._messages: list[dict[str, Any]] = []  # the chat so far, ending with the policy's last reply
        self._text = ""  # the text prompt so far, ending with the last completion's text
        self._lock = asyncio.Lock()
        self._sampling: asyncio.Task[list[Completion]] | None = None

    def trajectory(self, info: dict[str, Any]) -> Trajectory:
        return Trajectory(list(self.turns), info, prompt_ids=self.prompt_ids)

    async def aclose(self) -> None:
        """Stops a call still sampling (its program was stopped): its tokens stop counting against the
        rollout's permits before the rollout leaves."""
        if self._sampling is not None and not self._sampling.done():
            self._sampling.cancel()
            with contextlib.suppress(BaseException):
                await self._sampling

    # -- the three routes ---------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> tuple[Completion, dict[str, Any]]:
        """A chat call: its messages rendered by the chat template (the first) or cut to what follows the
        policy's last reply (the others); returns the completion and the assistant message answered."""
        messages = _messages(body)
        tools = body.get("tools")
        async with self._turn("chat"):
            if not self.turns:
                context = self._render(messages, tools)
                completion = await self._sample(context, [], body)
            else:
                added = self._added_messages(messages)
                completion = await self._sample(self.context, self._follow_up_ids(added), body)
            reply = _assistant_message(self.env.decode(completion.token_ids), tools)
            self._messages = [*messages, reply]
            return completion, reply

    async def complete(self, body: dict[str, Any]) -> tuple[Completion, str]:
        """A completions call with a prompt of token ids (which must extend the context) or of text (which
        must extend the text so far; only what it adds is tokenized)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one
        async with self._turn("completions"):
            if isinstance(prompt, str):
                if not self.turns:
                    completion = await self._sample(self._encode(prompt), [], body)
                else:
                    if not prompt.startswith(self._text):
                        raise ProxyError(
                            400,
                            "the prompt does not extend the text so far (the earlier prompt "
                            "and the completion it was answered)",
                        )
                    completion = await self._sample(self.context, self._encode(prompt[len(self._text) :]), body)
                text = self.env.decode(completion.token_ids)
                self._text = prompt + text
                return completion, text
            completion = await self._sample_ids(_token_ids(prompt, "prompt"), body)
            return completion, self.env.decode(completion.token_ids)

    async def generate(self, body: dict[str, Any]) -> Completion:
        """vLLM's token-in, token-out call: `token_ids` must extend the context."""
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ProxyError(400, "sampling_params must be an object")
        async with self._turn("generate"):
            return await self._sample_ids(_token_ids(body.get("token_ids"), "token_ids"), params)

    # -- turns ----------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _turn(self, route: str) -> AsyncIterator[None]:
        if self._lock.locked():
            raise ProxyError(409, "a call of this rollout is in flight: an episode's calls are one after another")
        if self._route is not None and self._route != route:
            raise ProxyError(400, f"this rollout called the {self._route} route before: one route per rollout")
        if self.failure is not None:
            raise ProxyError(502, f"this rollout's inference already failed: {self.failure}")
        async with self._lock:
            self._route = route
            yield

    def _render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        try:
            return chat_prompt_ids(self.env.tokenizer, messages, tools=tools)
        except Exception as exc:  # the template's own errors (a role it does not know) are the call's fault
            raise _unrenderable(exc) from exc

    def _added_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # The policy's reply stands for the ids it sampled, whatever the program wrote back in its place.
        known = len(self._messages)
        earlier = all(_same(a, b) for a, b in zip(messages[: known - 1], self._messages[: known - 1], strict=False))
        if len(messages) <= known or not earlier or messages[known - 1].get("role") != "assistant":
            raise ProxyError(
                400,
                f"the messages do not extend the conversation so far: the first {known - 1} "
                f"must be the earlier call's, then the assistant's reply, then the new ones",
            )
        return messages[known:]

    def _follow_up_ids(self, added: list[dict[str, Any]]) -> list[int]:
        last = self.turns[-1].completion_ids
        closed = bool(last) and last[-1] == self.follow_ups.stop_id
        try:
            return self.follow_ups.ids(added, closed)
        except Exception as exc:  # ChatTemplateError, or the template's own
            raise _unrenderable(exc) from exc

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.env.tokenizer.encode(text, add_special_tokens=False)]

    async def _sample_ids(self, token_ids: list[int], params: dict[str, Any]) -> Completion:
        if not self.turns:
            return await self._sample(token_ids, [], params)
        known = len(self.context)
        if token_ids[:known] != self.context:
            raise ProxyError(
                400,
                f"the token ids do not extend this rollout's context of {known} tokens (the "
                "earlier prompt, every completion and every reply)",
            )
        return await self._sample(self.context, token_ids[known:], params)

    async def _sample(self, context: list[int], env_ids: list[int], params: dict[str, Any]) -> Completion:
        if not self.turns and not context:
            raise ProxyError(400, "the prompt is empty")
        turn = len(self.turns) + 1
        if turn > self.env.max_turns:
            raise ProxyError(400, f"this rollout is out of turns (max_turns = {self.env.max_turns})")
        full = [*context, *env_ids]
        try:
            sampling = self.env.turn_sampling(self.sampling, turn, len(full))
        except ValueError as exc:
            raise ProxyError(400, str(exc)) from exc
        if sampling is None:
            raise ProxyError(400, f"no room is left to generate under model.max_context ({self.env.max_context})")
        requested = params.get("max_completion_tokens") or params.get("max_tokens")
        if isinstance(requested, int) and 0 < requested < sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=requested)
        try:
            # A copy: the context keeps growing, and a client may hold on to the list it was given.
            self._sampling = asyncio.ensure_future(self.client.complete(list(full), sampling, n=1))
            (completion,) = await self._sampling
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failure = exc
            raise ProxyError(502, f"inference failed: {type(exc).__name__}: {exc}") from exc
        if not self.turns:
            self.prompt_ids = list(context)
        self.context = full + list(completion.token_ids)
        self.turns.append(
            Turn(
                list(completion.token_ids),
                list(completion.logprobs),
                completion.finish_reason,
                list(env_ids),
                list(completion.policy_versions),
            )
        )
        return completion


def _unrenderable(exc: Exception) -> ProxyError:
    return ProxyError(400, f"the chat template cannot render these messages: {type(exc).__name__}: {exc}")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ProxyError(400, "messages must be a non-empty list of message objects")
    return messages


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("role", "content", "name", "tool_call_id")
    return all(a.get(k) == b.get(k) for k in keys)


def _token_ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
        raise ProxyError(400, f"{field} must be a non-empty list of token ids")
    return list(value)


def _assistant_message(text: str, tools: Any) -> dict[str, Any]:
    """The reply as OpenAI's assistant message; with tools offered, the <tool_call> blocks the model wrote
    become `tool_calls` and the text before them its content."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)] if tools else []
    if not calls:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": text.split("<tool_call>", 1)[0].strip() or None,
        "tool_calls": [
            {
                "id": f"call_{secrets.token_hex(6)}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ],
    }


# -- the server --------------------------------------------------------------------------------------

ROLLOUT_HEADER = "X-Beam-RL-Rollout"  # names the session on the shared /v1
SECRET_HEADER = "X-Beam-RL-Secret"  # the session's secret, for a client whose Authorization carries another key
RESPONSES_REFUSED = (
    "the inference proxy serves chat completions, not the Responses API (/v1/responses): use "
    "chat completions (openai-agents: OpenAIChatCompletionsModel, or "
    "set_default_openai_api('chat_completions'))"
)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where one episode's calls go: `base_url` with `secret` as the API key (an OpenAI client's), or the
    proxy's shared `/v1` with `headers` on each call (one client for many rollouts). The secret is left out
    of the repr, so an endpoint logged by mistake does not give it away."""

    root: str
    key: str
    secret: str = dataclasses.field(repr=False)

    @property
    def base_url(self) -> str:
        return f"{self.root}/rollouts/{self.key}/v1"

    @property
    def shared_base_url(self) -> str:
        return f"{self.root}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {ROLLOUT_HEADER: self.key, SECRET_HEADER: self.secret}


@dataclasses.dataclass(frozen=True)
class _Session:
    episode: Episode
    secret: str


def check_address(host: str, advertise: str | None) -> None:
    """ValueError when the proxy could not name itself: bound to every address, with none advertised."""
    if advertise is None and host in ("0.0.0.0", "::"):
        raise ValueError(
            f"a proxy bound to {host!r} needs the address to advertise: the name its harness reaches this host by"
        )


async def shared_proxy(host: str = LOOPBACK, advertise: str | None = None) -> InferenceProxy:
    """The proxy of the running event loop on `host` (advertised as `advertise`), started by its first
    caller, closed with its dispatcher."""

    async def start(stack: contextlib.AsyncExitStack) -> InferenceProxy:
        proxy = InferenceProxy(host, advertise)
        await proxy.start()
        stack.push_async_callback(proxy.close)
        return proxy

    return await loop_local((InferenceProxy, host, advertise), start)


class InferenceProxy:
    """The OpenAI-compatible server of one event loop's episodes, bound to `host` (127.0.0.1 by default);
    its URLs name `advertise` (default: `host`)."""

    def __init__(self, host: str = LOOPBACK, advertise: str | None = None) -> None:
        check_address(host, advertise)
        self.host = host
        self.advertise = advertise or host
        self._sessions: dict[str, _Session] = {}
        self._keys: dict[bytes, str] = {}  # each session's key by its secret, for a call that names no session
        self._runner: web.AppRunner | None = None
        self._started = asyncio.Lock()
        self.port: int | None = None

    async def start(self) -> None:
        async with self._started:
            if self._runner is not None:
                return
            app = web.Application()
            for root in ("/rollouts/{key}", ""):  # the rollout named in the path, or in ROLLOUT_HEADER
                app.add_routes(
                    [
                        web.post(root + "/v1/chat/completions", self._chat),
                        web.post(root + "/v1/completions", self._complete),
                        web.post(root + "/inference/v1/generate", self._generate),
                        web.get(root + "/v1/models", self._models),
                        web.post(root + "/v1/responses", self._responses),
                    ]
                )
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner
            warn_if_open(
                self.host,
                self.port,
                "the inference proxy: chat with the policy, guarded only by each rollout's secret",
                "the environment's proxy_host",
            )

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @contextlib.contextmanager
    def serve(self, episode: Episode) -> Iterator[Endpoint]:
        """The episode's endpoint, valid until the block ends."""
        key = secrets.token_urlsafe(16)
        self._sessions[key] = session = _Session(episode, secrets.token_urlsafe(32))
        self._keys[session.secret.encode()] = key
        try:
            name = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
            yield Endpoint(f"http://{name}:{self.port}", key, session.secret)
        finally:
            del self._sessions[key], self._keys[session.secret.encode()]

    def _episode(self, request: web.Request) -> Episode:
        """The episode the request names (by its URL or ROLLOUT_HEADER; on the shared /v1 without the header,
        the one whose secret it carries: litellm lists models at the server's root), if it carries that
        session's secret."""
        offered = _offered_secrets(request)
        if not offered:
            raise ProxyError(
                401,
                "this call carries no rollout secret: send the one beam-rl gave the program as "
                f"its API key (Authorization: Bearer, OPENAI_API_KEY) or in {SECRET_HEADER}",
            )
        named = request.match_info.get("key") or request.headers.get(ROLLOUT_HEADER, "")
        session = self._sessions.get(named or next((self._keys[s] for s in offered if s in self._keys), ""))
        if session is None and named:
            raise ProxyError(404, "no rollout runs under this URL (it has ended, or never was)")
        if session is None or not any(hmac.compare_digest(secret, session.secret.encode()) for secret in offered):
            raise ProxyError(
                403, "this call's secret is not this rollout's: a program may call only its own rollout's endpoint"
            )
        return session.episode

    async def _models(self, request: web.Request) -> web.StreamResponse:
        async def call(episode: Episode, body: dict[str, Any]) -> dict[str, Any]:
            return _model_list(episode.env.max_context)

        return await self._answer(request, call)

    async def _responses(self, request: web.Request) -> web.Response:
        return _error(ProxyError(400, RESPONSES_REFUSED))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        async def call(episode: Episode, body: dict[str, Any]) -> dict[str, Any]:
            completion, reply = await episode.chat(body)
            finish = "tool_calls" if reply.get("tool_calls") else completion.finish_reason
            choice = {"index": 0, "message": reply, "finish_reason": finish, "token_ids": completion.token_ids}
            return _envelope("chat.completion", episode, completion, choice)

        return await self._answer(request, call)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        async def call(episode: Episode, body: dict[str, Any]) -> dict[str, Any]:
            completion, text = await episode.complete(body)
            return _envelope(
                "text_completion",
                episode,
                completion,
                {
                    "index": 0,
                    "text": text,
                    "finish_reason": completion.finish_reason,
                    "token_ids": completion.token_ids,
                },
            )

        return await self._answer(request, call)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        async def call(episode: Episode, body: dict[str, Any]) -> dict[str, Any]:
            completion = await episode.generate(body)
            return {
                "request_id": body.get("request_id") or f"gen-{secrets.token_hex(8)}",
                "model": MODEL_NAME,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": completion.token_ids,
                        "logprobs": {"content": [{"logprob": lp} for lp in completion.logprobs]},
                        "finish_reason": completion.finish_reason,
                    }
                ],
            }

        return await self._answer(request, call)

    async def _answer(self, request: web.Request, call: Any) -> web.StreamResponse:
        try:
            episode = self._episode(request)
            body: dict[str, Any] = {}
            if request.method == "POST":
                try:
                    body = await request.json()
                except ValueError:
                    raise ProxyError(400, "the request body is not JSON") from None
                if not isinstance(body, dict):
                    raise ProxyError(400, "the request body must be a JSON object")
            answer = await call(episode, body)
        except ProxyError as exc:
            return _error(exc)
        if body.get("stream"):
            return await _stream(request, answer)
        return web.json_response(answer)


def _offered_secrets(request: web.Request) -> list[bytes]:
    """The secrets a request carries: its bearer token and SECRET_HEADER (bytes: compare_digest takes any)."""
    bearer = request.headers.get("Authorization", "")
    offered = [bearer[len("Bearer ") :] if bearer.startswith("Bearer ") else "", request.headers.get(SECRET_HEADER, "")]
    return [secret.encode() for secret in offered if secret]


def _error(exc: ProxyError) -> web.Response:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return web.json_response({"error": {"message": exc.message, "type": kind, "code": exc.status}}, status=exc.status)


def _model_list(max_context: int | None) -> dict[str, Any]:
    """The policy as vLLM lists a model: `max_model_len` is the context a rollout may fill (model.max_context),
    which agent frameworks read to size their prompts."""
    model: dict[str, Any] = {
        "id": MODEL_NAME,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "beam-rl",
        "root": MODEL_NAME,
        "parent": None,
    }
    if max_context is not None:
        model["max_model_len"] = max_context
    return {"object": "list", "data": [model]}


def _envelope(kind: str, episode: Episode, completion: Completion, choice: dict[str, Any]) -> dict[str, Any]:
    completion_tokens = len(completion.token_ids)
    prompt_tokens = len(episode.context) - completion_tokens  # the context the completion was sampled after
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(8)}",
        "object": kind,
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _stream(request: web.Request, answer: dict[str, Any]) -> web.StreamResponse:
    """A streamed call answered as one chunk with the whole reply, then its finish, then [DONE]: the turn
    is sampled (and possibly failed over) whole before the program sees it."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    (choice,) = answer["choices"]
    chat = answer["object"] == "chat.completion"
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        chunks = [
            {"index": 0, "delta": delta, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]},
        ]
    else:
        chunks = [{"index": 0, "text": choice["text"], "finish_reason": choice["finish_reason"]}]
    for chunk in chunks:
        await response.write(f"data: {json.dumps({**head, 'choices': [chunk]})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
