"""vLLM's runtime LoRA routes for the embedded server (`--enable-lora`): `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, and which adapter a request's `model` names.

- A loaded adapter is served under its own name; a request naming it samples with it, from its first token to
  its last, whatever is loaded or unloaded meanwhile (vLLM fixes a request's adapter when it is admitted).
- A name loaded twice, an unknown name unloaded, or a request naming an adapter no longer loaded get vLLM's
  answers (400, 404, 404); an adapter that does not fit the model is refused before it reaches the model.
- The model backend applies adapters (peft, `generator.ModelGenerator.load_adapter`); the instant and simulated
  backends sample no weights, so for them an adapter is a name alone.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

from aiohttp import web

from beam_rl.rundir.checkpoint_shapes import CheckpointError, is_adapter, validate_checkpoint
from beam_rl.standin.protocol import RequestError, error_response
from beam_rl.standin.stepped import ModelBackend


class LoraAdapters:
    """The adapters a server holds, by name, and the routes that change them."""

    def __init__(self, backend: Any, model_dir: pathlib.Path | None) -> None:
        self._backend = backend
        self._model_dir = model_dir
        self.loaded: dict[str, str] = {}  # name -> path
        self._unloaded: set[str] = set()
        if isinstance(backend, ModelBackend):
            import peft  # noqa: F401 (now, not on the model thread at the first load: ~0.3 s without a step)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/load_lora_adapter", self._load), web.post("/v1/unload_lora_adapter", self._unload)]

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter a request names in `model` (None: the base model); RequestError for one unloaded."""
        if model in self.loaded:
            return model
        if model in self._unloaded:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return None

    def cards(self, parent: str) -> list[dict[str, Any]]:
        """The /v1/models entries of the loaded adapters, as vLLM lists them."""
        return [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": path,
                "parent": parent,
            }
            for name, path in self.loaded.items()
        ]

    async def _load(self, request: web.Request) -> web.Response:
        try:
            name, path = await _name_and_path(request, with_path=True)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if name in self.loaded:
            return error_response(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        try:
            if self._model_dir is not None:
                validate_checkpoint(path, self._model_dir, lora=True)
            elif not is_adapter(path):
                raise CheckpointError(f"{path}: no adapter_config.json")
        except CheckpointError as exc:
            return error_response(400, f"Loading lora {name} failed: {exc}", "BadRequestError")
        if isinstance(self._backend, ModelBackend):
            await self._backend.load_adapter(name, path)
        self.loaded[name] = path
        self._unloaded.discard(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        try:
            name, _ = await _name_and_path(request, with_path=False)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if name not in self.loaded:
            return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        self._unloaded.add(name)
        if isinstance(self._backend, ModelBackend):
            await self._backend.unload_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _name_and_path(request: web.Request, with_path: bool) -> tuple[str, str]:
    try:
        body = await request.json()
        name = body["lora_name"]
        path = body["lora_path"] if with_path else ""
    except (ValueError, KeyError, TypeError):
        wanted = '{"lora_name": NAME, "lora_path": DIR}' if with_path else '{"lora_name": NAME}'
        raise RequestError(400, f"expected {wanted}") from None
    if not isinstance(name, str) or not name or not isinstance(path, str):
        raise RequestError(400, "lora_name and lora_path must be non-empty strings")
    return name, path
