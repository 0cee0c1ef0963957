"""The start-up checks of a run, before anything starts: the model's files, the environments' datasets, the
run directory's records and published weights, and every inference server.

Each check returns the problems it finds (`Problem`: where, and what is wrong with the fix); `refuse` raises
them as one error of the kind they are, which the CLI prints as one red line. So the CLI's preflight and the
job's start refuse a run in one place, and a check is a function of what it checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from beam_rl.config import ConfigError, RunConfig, shards_problem
from beam_rl.envs.datasets import DatasetError
from beam_rl.inference.client import (
    LORA_SERVER_HINT,
    InferenceAuthError,
    InferenceClient,
    InferenceError,
    InferenceHTTPError,
)
from beam_rl.model import location
from beam_rl.rundir import RunDir, RunDirError
from beam_rl.rundir.checkpoint_shapes import CheckpointError, matrix_module_names, tensor_shapes, validate_checkpoint
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.wiring import JobParts, build_envs

_LOG = logging.getLogger(__name__)

SERVERS_NOT_READY = "inference servers cannot serve this run: "


@dataclass(frozen=True)
class Problem:
    """One reason a run cannot start: `what` is wrong and how to fix it, `where` (the config key it is at; ""
    when it is not one key), and `kind`, the error that refuses it (ConfigError, RunDirError or
    ServersNotReadyError)."""

    what: str
    where: str = ""
    kind: type[Exception] = ConfigError


def refuse(problems: Sequence[Problem], source: str = "of this run") -> None:
    """Raises the problems as one error of the first one's kind (all of that kind in it); nothing when there
    are none. `source` names the config in a ConfigError."""
    if not problems:
        return
    kind = problems[0].kind
    same = [p for p in problems if p.kind is kind]
    if kind is ConfigError:
        raise ConfigError(source, [(p.where, p.what) for p in same])
    if kind is ServersNotReadyError:
        raise ServersNotReadyError(SERVERS_NOT_READY + "; ".join(p.what for p in same))
    raise kind(same[0].what)


# -- the model --------------------------------------------------------------------------------------------


def model_problems(config: RunConfig) -> list[Problem]:
    """model.name is "tiny" or a local Hugging Face directory with a model config, a tokenizer that loads,
    and (where a server or the trainer here loads it) safetensors weights; then its context and LoRA targets."""
    if config.model.name != "tiny":
        found = _model_dir_problem(config)
        if found:
            return [Problem(found, "model.name")]
    return context_problems(config) + lora_target_problems(config)


def _model_dir_problem(config: RunConfig) -> str | None:
    path = Path(config.model.name).expanduser()
    if not path.is_dir():
        return (
            f"{path} is not a directory: give \"tiny\" or a local Hugging Face model directory (nothing is downloaded)"
        )
    try:
        int(json.loads((path / "config.json").read_bytes())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{path / 'config.json'}: not a model config with a vocab_size ({type(err).__name__}: {err})"
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # an unknown model_type, a config its class refuses
        return (
            f"{path / 'config.json'}: transformers cannot load this model "
            f"({type(err).__name__}: {str(err).splitlines()[0]})"
        )
    try:
        location.tokenizer_for(config.model.name)
    except Exception as err:  # transformers raises many kinds for a directory it cannot use
        return f"{path}: its tokenizer does not load ({type(err).__name__}: {str(err).splitlines()[0]})"
    if not config.inference.urls or config.trainer.kind == "reference":
        try:
            tensor_shapes(path)
        except CheckpointError as err:
            return f"{err} (the embedded servers and the reference trainer load the model's weights)"
    return None


def context_problems(config: RunConfig) -> list[Problem]:
    """model.max_context and inference.max_tokens fit the model's own context (its config.json's
    max_position_embeddings, where it says): a server would refuse every longer request."""
    path = location.model_dir(config) / "config.json"
    context = json.loads(path.read_bytes()).get("max_position_embeddings")
    if not isinstance(context, int):
        return []
    return [
        Problem(f"{value} is above the model's context: max_position_embeddings = {context} in {path}", key)
        for key, value in (
            ("model.max_context", config.model.max_context),
            ("inference.max_tokens", config.inference.max_tokens),
        )
        if value > context
    ]


def lora_target_problems(config: RunConfig) -> list[Problem]:
    """Every module trainer.lora.target_modules names is a weight matrix of the model."""
    lora = config.trainer.lora
    if lora is None:
        return []
    try:
        modules = matrix_module_names(location.model_dir(config))
    except CheckpointError:
        return []  # no weights here: nothing trains a LoRA adapter in this process, and model_problems said so
    missing = [name for name in lora.target_modules if name not in modules]
    if not missing:
        return []
    return [
        Problem(
            f"{missing} name no weight matrix of {config.model.name} (it has {sorted(modules)})",
            "trainer.lora.target_modules",
        )
    ]


# -- the datasets -----------------------------------------------------------------------------------------


LoadedSplit = tuple[str, str, int, list[DatasetError]]  # (env, split, rows kept, rows skipped)


def load_datasets(config: RunConfig) -> tuple[list[LoadedSplit], list[Problem]]:
    """Every split the run will read, loaded, and the environments that cannot be built. The first bad row
    of a dataset raises its DatasetError (named by file, line and field), unless run.bad_rows = "skip"."""
    from beam_rl.envs.plugins import PluginError

    loaded: list[LoadedSplit] = []
    problems = []
    for i, env in enumerate(config.envs):
        kind_key = f"envs[{i}].kind" if env.kind else f"envs[{i}].name"
        try:
            built = build_envs(config.model_copy(update={"envs": [env]}))[env.name]
        except DatasetError:
            raise
        except KeyError as err:  # an environment name nobody registered
            problems.append(Problem(str(err.args[0]), kind_key))
            continue
        except (PluginError, ImportError) as err:  # a plug-in (or a library it needs) that is not usable here
            problems.append(Problem(str(err), kind_key))
            continue
        except (TypeError, ValueError) as err:  # constructor arguments it does not take or accept
            problems.append(Problem(str(err), f"envs[{i}].args"))
            continue
        # The held-out split too when evaluation is on: the source reads it mid-run.
        for split in [env.split] + (["eval"] if config.eval.every_steps else []):
            rows = built.load_rows(split)
            loaded.append((env.name, split, len(rows), list(getattr(built, "skipped_rows", {}).get(split, []))))
    return loaded, problems


# -- the run directory ------------------------------------------------------------------------------------


def check_run_records(run_dir: RunDir) -> None:
    """Before a run resumes: every commit record and every complete line of metrics.jsonl reads (the
    source resumes from the records; the observer and the trainer read the metrics), and every file of
    the steps no published weights have trained yet matches its record (the trainer reads them next).
    The reader's own RunDirError or CommitRecordError naming the first damaged file otherwise."""
    run_dir.read_metrics()  # a torn last line is no error: the job drops it before appending (repair_metrics)
    trained = run_dir.latest_stable_weights()
    for step in run_dir.committed_steps():
        record = run_dir.read_commit(step)
        if trained is None or step > trained[0]:
            run_dir.verify_step(record)


def published_weights_problems(run_dir: RunDir, config: RunConfig) -> list[Problem]:
    """The newest weights the trainer published (STABLE) fit the model: every server loads them before
    any group starts, and the trainer resumes from them."""
    latest = run_dir.latest_stable_weights()
    if latest is None:
        return []
    step, path = latest
    try:
        validate_checkpoint(path, location.model_dir(config), lora=config.trainer.lora is not None)
    except CheckpointError as err:
        return [
            Problem(
                f"the newest published weights, step {step}, cannot be loaded: {err}. Remove {path} "
                "and the run resumes from the weights published before them",
                kind=RunDirError,
            )
        ]
    return []


# -- the inference servers --------------------------------------------------------------------------------


def check_servers(parts: JobParts, server_urls: list[str]) -> None:
    """`server_problems`, refused: ConfigError on dispatch.shards, ServersNotReadyError naming each server."""
    refuse(server_problems(parts, server_urls))


def server_problems(parts: JobParts, server_urls: list[str]) -> list[Problem]:
    """Before a pipeline starts, every server is asked what it serves (`/v1/models`, which vLLM guards
    with its API key; on the generate route also for one token there), all in parallel.
    - A refused key, an untrusted certificate or a missing route: a problem naming the server.
    - No server answering within `inference.startup_timeout_s`: a problem naming each and what
      it last said; a run never waits the longer `inference.all_servers_down_timeout_s` for servers that
      were never up (the dispatcher keeps the short patience too until one answers a request).
    - Some answering: the others are named in a warning and left to the dispatcher's re-probes.
    - With dispatch.concurrency.mode = "kv": a server whose /metrics has no KV-cache usage is refused.
    - With trainer.lora: a server without vLLM's runtime LoRA routes is refused.
    - A server whose context (max_model_len in /v1/models) is below model.max_context is refused.
    No completion is requested on the completions route: a server's own counters see only the run.
    Each dispatch shard drives servers of its own: at least `dispatch.shards` servers (a problem at the key)."""
    config, key = parts.config, parts.api_key
    problem = shards_problem(config.dispatch.shards, len(server_urls))  # the config counted inference.urls
    if problem:
        return [Problem(problem, "dispatch.shards")]
    patience_s = config.inference.startup_timeout_s

    async def attempt(client: InferenceClient, url: str) -> tuple[str | None, bool]:
        """(what is wrong, whether it may pass by itself), or (None, False) when the server is ready."""
        try:
            await client.check_access()
        except InferenceAuthError as err:
            return (
                (
                    f"{url} refuses the API key in ${config.inference.api_key_env} (HTTP {err.status})"
                    if key
                    else f"{url} wants an API key (HTTP {err.status}): set inference.api_key_env"
                ),
                False,
            )
        except InferenceHTTPError as err:
            return f"{url} answers with HTTP {err.status}", True
        except InferenceError as err:
            if "certificate" in str(err).lower():
                return f"{url}: TLS failed ({err}); set inference.ca_bundle to the CA that signed it", False
            return f"{url} cannot be reached ({err})", True
        try:
            context = await client.served_context()
        except InferenceError:
            context = None  # it answered the same route a moment ago: left to the dispatcher's probes
        if context is not None and config.model.max_context > context:
            return (
                f"{url} serves a context of {context} tokens (max_model_len in /v1/models): "
                f"model.max_context = {config.model.max_context} is above it",
                False,
            )
        if config.inference.route == "generate":
            try:
                await client.check_generate_route()
            except InferenceHTTPError as err:  # the key passed above: a 403 is vLLM's disabled route
                if err.status in (403, 404, 405):
                    return (
                        f"{url} does not serve /inference/v1/generate (HTTP {err.status}): start vLLM 0.32"
                        " or later with --enable-scale-out, or set inference.route = \"completions\"",
                        False,
                    )
                return f"{url} answers the generate route with HTTP {err.status}", True
            except InferenceError as err:
                return f"{url} cannot be reached ({err})", True
        if config.trainer.lora is not None:
            try:
                if not await client.serves_lora():
                    return f"{url} serves no LoRA adapters (trainer.lora): {LORA_SERVER_HINT}", False
            except InferenceError as err:
                return f"{url} cannot say whether it serves LoRA adapters ({err})", True
        if config.dispatch.concurrency.mode == "kv":
            try:
                load = await client.load()
            except InferenceHTTPError as err:
                return (
                    f"{url} does not serve /metrics (HTTP {err.status}), which dispatch.concurrency.mode = "
                    "\"kv\" reads",
                    err.status >= 500,
                )
            except InferenceError as err:
                return f"{url}/metrics cannot be read ({err})", True
            if load.kv_cache_usage is None:
                return (
                    f"{url}/metrics has no vllm:kv_cache_usage_perc, which dispatch.concurrency.mode = \"kv\" "
                    "reads: use \"goodput\" or \"fixed\" with this server",
                    False,
                )
        return None, False

    async def check_all() -> list[tuple[str | None, bool]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience_s
        one_ready = asyncio.Event()

        async def check(url: str) -> tuple[str | None, bool]:
            async with parts.client(url) as client:
                while True:
                    problem, transient = await attempt(client, url)
                    if problem is None:
                        one_ready.set()
                    if problem is None or not transient or one_ready.is_set() or loop.time() >= deadline:
                        return problem, transient
                    with contextlib.suppress(TimeoutError):  # retry soon, or stop once another is ready
                        await asyncio.wait_for(one_ready.wait(), min(0.5, max(0.0, deadline - loop.time())))

        return list(await asyncio.gather(*(check(url) for url in server_urls)))

    results = asyncio.run(check_all())
    refusals = [problem for problem, transient in results if problem and not transient]
    down = [problem for problem, transient in results if problem and transient]
    if refusals or len(down) == len(server_urls):
        detail = refusals + down
        if len(down) == len(server_urls):
            detail.append(f"none answered within inference.startup_timeout_s = {patience_s:g} s")
        return [Problem(what, kind=ServersNotReadyError) for what in detail]
    if down:
        _LOG.warning("not ready at start-up, left to the dispatcher's re-probes: %s", "; ".join(down))
    return []
