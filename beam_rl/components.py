"""Builds the domain components of a run from its RunConfig: the one place that wires them together.

Beam DoFns call these in `setup` on the worker, so what travels in the pipeline graph is only the
config (a pydantic model) and the inference server URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Callable

from beam_rl.config import ConfigError, RunConfig, shards_problem
from beam_rl.dispatch import Dispatcher, DispatcherThread, Restore
from beam_rl.dispatch.concurrency import ConcurrencyController, concurrency_controller
from beam_rl.envs import env_class, make_env
from beam_rl.envs.base import Environment
from beam_rl.inference.client import (
    LORA_SERVER_HINT,
    InferenceAuthError,
    InferenceClient,
    InferenceError,
    InferenceHTTPError,
)
from beam_rl.inference.types import SamplingParams
from beam_rl.packing.batches import BatchBuilder
from beam_rl.packing.packer import BatchCutter
from beam_rl.rundir.checkpoint_shapes import validate_checkpoint
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.scoring.advantages import AdvantageAlgorithm, get_algorithm
from beam_rl.scoring.filters import RolloutFilter, make_filter
from beam_rl.source.schedule import EnvSchedule, PromptSchedule
from beam_rl.source.source import SourceParts
from beam_rl.model.location import model_dir, tokenizer_for, vocab_size
from beam_rl.types import Rollout

_LOG = logging.getLogger(__name__)


def build_envs(config: RunConfig) -> dict[str, Environment]:
    """Every env entry's environment, by entry name (built once per worker process, in the dispatcher
    and in the scoring stage alike)."""
    tokenizer = tokenizer_for(config.model.name)
    envs = {}
    for env in config.envs:
        kind = env.kind or env.name
        accepts = inspect.signature(env_class(kind)).parameters
        kwargs: dict[str, Any] = {"max_turns": env.max_turns}
        if "bad_rows" in accepts:
            kwargs["bad_rows"] = config.run.bad_rows
        if "max_context" in accepts:  # multi-turn: the conversation must fit the model
            kwargs["max_context"] = config.model.max_context
        envs[env.name] = make_env(kind, tokenizer, env_name=env.name, **{**kwargs, **env.args})
    return envs


def build_schedule(config: RunConfig, envs: dict[str, Environment], split: str | None = None) -> PromptSchedule:
    """The training prompts: one stream taking turns, or a stream per environment when they are mixed by
    ratio (the source then chooses the stream, beam_rl/source/mixing.py)."""
    return PromptSchedule([
        EnvSchedule(e.name, envs[e.name].load_rows(split or e.split)[:e.limit], e.group_size, e.epochs,
                    shuffle_seed=config.run.seed if e.curriculum is not None and e.curriculum.shuffle else None)
        for e in config.envs
    ], stream_per_env=any(e.ratio is not None for e in config.envs))


def eval_schedule(config: RunConfig, envs: dict[str, Environment]) -> PromptSchedule:
    """The held-out prompts of an evaluation round: each environment's eval split (its first eval.limit
    rows), once, `eval.samples_per_prompt` rollouts each."""
    ev = config.eval
    return PromptSchedule([EnvSchedule(e.name, envs[e.name].load_rows("eval")[:ev.limit], ev.samples_per_prompt, 1)
                           for e in config.envs])


def algorithms(config: RunConfig) -> dict[str, AdvantageAlgorithm]:
    return {e.name: get_algorithm(e.algorithm, **e.algorithm_args) for e in config.envs}


def pre_batch_filters(config: RunConfig) -> list[RolloutFilter]:
    f = config.filters
    return [
        make_filter("zero_advantage", mode=f.zero_advantage.mode),
        make_filter("gibberish", mode=f.gibberish.mode, vocab_size=vocab_size(config),
                    token_id_frac=f.gibberish.token_id_frac, logprob_offset=f.gibberish.logprob_offset),
        make_filter("repetition", mode=f.repetition.mode, window=f.repetition.window,
                    prob_threshold=f.repetition.prob_threshold),
        make_filter("overlong", mode=f.overlong.mode),
    ]


def post_batch_filters(config: RunConfig, check_staleness: bool = True) -> list[RolloutFilter]:
    """The staleness bound; off when no trainer publishes weights (the policy never changes)."""
    if not check_staleness:
        return []
    return [make_filter("stale", max_off_policy_steps=config.off_policy.max_off_policy_steps)]


def batch_builder(config: RunConfig, next_step: int, check_staleness: bool = True) -> BatchBuilder:
    b = config.batch
    cutter = BatchCutter(rollouts_per_step=None if b.token_budget else b.rollouts_per_step,
                         token_budget=b.token_budget)
    return BatchBuilder(cutter, b.seq_len, b.trainer_ranks, post_batch_filters(config, check_staleness),
                        next_step=next_step)


def sampling_params(config: RunConfig, envs: dict[str, Environment]) -> dict[str, SamplingParams]:
    inf = config.inference
    return {
        name: SamplingParams(max_tokens=inf.max_tokens, temperature=inf.temperature,
                             stop_token_ids=tuple(env.stop_token_ids()))
        for name, env in envs.items()
    }


def checkpoint_validator(config: RunConfig) -> Callable[[Path], None]:
    """Checks a published checkpoint against the policy model's tensor names and shapes."""
    return functools.partial(validate_checkpoint, reference_model_dir=model_dir(config),
                             lora=config.trainer.lora is not None)


# A source whose dispatch transform stopped calling it (the job was cancelled, or the runner restored the
# work elsewhere) closes itself after this long; a restore that comes back later rebuilds it.
ABANDONED_SOURCE_S = 120.0


def api_key(config: RunConfig) -> str | None:
    """The servers' API key, read from the environment variable `inference.api_key_env` names (None when it
    names none); ValueError naming the variable when it is unset or empty."""
    name = config.inference.api_key_env
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ValueError(f"inference.api_key_env names the environment variable {name}, which is not set "
                         "(or empty): export the servers' API key in it")
    return key


def inference_client(config: RunConfig, url: str, key: str | None, version: int = 0) -> InferenceClient:
    """The client of one inference server, as the run's config sets it up."""
    inf = config.inference
    return InferenceClient(url, model=config.model.name, timeout_s=inf.request_timeout_s,
                           max_retries=inf.max_retries, backoff_s=inf.retry_backoff_s, stream=inf.stream,
                           api_key=key, ca_bundle=inf.ca_bundle, version=version, route=inf.route,
                           lora=config.trainer.lora is not None, vocab_size=vocab_size(config),
                           max_response_bytes=inf.max_response_mb << 20)


def dispatcher_thread(config: RunConfig, server_urls: list[str], envs: dict[str, Environment],
                      policy_version: Callable[[], int], max_inflight: int | None = None,
                      start_cap: int | None = None) -> DispatcherThread:
    """A dispatcher on its own event-loop thread, with one client per inference server and
    `max_inflight` permits (default: the config's); a concurrency controller starts at `start_cap` (default:
    dispatch.concurrency.start)."""
    inf = config.inference
    modes = {e.name: e.mode for e in config.envs}
    sampling = sampling_params(config, envs)
    key = api_key(config)

    def build(emit: Callable[[Rollout], None], restore: Restore) -> Dispatcher:
        # At version 0 like the WeightSync that then brings them to the newest published weights.
        clients = [inference_client(config, url, key) for url in server_urls]
        ceiling = max_inflight or inf.max_inflight
        return Dispatcher(clients, envs, modes, sampling, ceiling,
                          policy_version, emit, seed=config.run.seed, max_redispatches=inf.max_redispatches,
                          max_regenerations=config.off_policy.max_regenerations,
                          stale_rule=config.off_policy.stale_rule, restore=restore,
                          concurrency=concurrency_for(config, ceiling, start_cap),
                          max_off_policy_steps=config.off_policy.max_off_policy_steps,
                          max_context=config.model.max_context)

    return DispatcherThread(build, abandoned_after_s=ABANDONED_SOURCE_S,
                            connect=lambda url: inference_client(config, url, key),
                            drain_timeout_s=inf.drain_timeout_s)


def concurrency_for(config: RunConfig, ceiling: int, start_cap: int | None = None) -> ConcurrencyController:
    """The in-flight controller of one shard's dispatcher holding `ceiling` permits."""
    c = config.dispatch.concurrency
    start = start_cap if start_cap is not None else c.start  # the controller holds it within [1, ceiling]
    return concurrency_controller(c.mode, ceiling, start=start, kv_soft_cap=c.kv_soft_cap)


def source_parts(config: RunConfig) -> SourceParts:
    """What a shard's RolloutSource runs with, built once per source on its worker."""
    envs = build_envs(config)
    return SourceParts(
        envs=envs,
        schedule=build_schedule(config, envs),
        eval_schedule=eval_schedule(config, envs) if config.eval.every_steps else None,
        dispatcher_thread=functools.partial(dispatcher_thread, config),
        validate_checkpoint=checkpoint_validator(config),
    )
