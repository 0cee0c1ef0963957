"""The wiring: builds every part of a run from its RunConfig and hands them down, the one place that does.

Each Beam step calls it once in `setup` on the worker and keeps the bundle it returns (`DispatchParts`,
`ScoringParts`, `PackingParts`, `EvalParts`), so what travels in the pipeline graph is only the config (a
pydantic model), the inference server URLs and the run directory; the job calls it for the schedule's size
(`SourceSpec`) and for the clients of its start-up checks. No domain module imports it
(tests/architecture/test_layering.py): they are handed their parts.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from beam_rl.config import RunConfig
from beam_rl.dispatch import Dispatcher, DispatcherThread, Restore
from beam_rl.dispatch.concurrency import ConcurrencyController, committed_concurrency, concurrency_controller
from beam_rl.dispatch.weight_sync import WeightSync
from beam_rl.envs import env_class, make_env
from beam_rl.envs.base import Environment
from beam_rl.fleet.assignment import FleetFollower
from beam_rl.inference.client import InferenceClient
from beam_rl.inference.types import SamplingParams
from beam_rl.model.location import model_dir, tokenizer_for, vocab_size
from beam_rl.observe.replay import ReplayParts, run_config, staleness_checked
from beam_rl.packing.batches import BatchBuilder
from beam_rl.packing.packer import BatchCutter
from beam_rl.rundir import RunDir
from beam_rl.rundir.checkpoint_shapes import validate_checkpoint
from beam_rl.scoring.advantages import AdvantageAlgorithm, get_algorithm
from beam_rl.scoring.filters import RolloutFilter, make_filter
from beam_rl.scoring.group import GroupScoring
from beam_rl.source.admission import limits_for
from beam_rl.source.commits import CommittedSteps
from beam_rl.source.curriculum import Curriculum
from beam_rl.source.eval_rounds import EvalRounds
from beam_rl.source.mixing import EnvMix
from beam_rl.source.restriction import DispatchRange
from beam_rl.source.schedule import EnvSchedule, PromptSchedule
from beam_rl.source.shard import Shard
from beam_rl.source.source import RolloutSource, SourceParts, SourceSpec
from beam_rl.source.status import ErrorTally, ProgressWatch, ServersDownWatch, StatusBoard
from beam_rl.types import Rollout


def build_envs(config: RunConfig) -> dict[str, Environment]:
    """Every env entry's environment, by entry name (built once per step instance on a worker, in the
    dispatcher and in the scoring stage alike)."""
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
    return PromptSchedule(
        [
            EnvSchedule(
                e.name,
                envs[e.name].load_rows(split or e.split)[: e.limit],
                e.group_size,
                e.epochs,
                shuffle_seed=config.run.seed if e.curriculum is not None and e.curriculum.shuffle else None,
            )
            for e in config.envs
        ],
        stream_per_env=any(e.ratio is not None for e in config.envs),
    )


def eval_schedule(config: RunConfig, envs: dict[str, Environment]) -> PromptSchedule:
    """The held-out prompts of an evaluation round: each environment's eval split (its first eval.limit
    rows), once, `eval.samples_per_prompt` rollouts each."""
    ev = config.eval
    return PromptSchedule(
        [EnvSchedule(e.name, envs[e.name].load_rows("eval")[: ev.limit], ev.samples_per_prompt, 1) for e in config.envs]
    )


def algorithms(config: RunConfig) -> dict[str, AdvantageAlgorithm]:
    return {e.name: get_algorithm(e.algorithm, **e.algorithm_args) for e in config.envs}


def pre_batch_filters(config: RunConfig) -> list[RolloutFilter]:
    f = config.filters
    return [
        make_filter("zero_advantage", mode=f.zero_advantage.mode),
        make_filter(
            "gibberish",
            mode=f.gibberish.mode,
            vocab_size=vocab_size(config),
            token_id_frac=f.gibberish.token_id_frac,
            logprob_offset=f.gibberish.logprob_offset,
        ),
        make_filter(
            "repetition", mode=f.repetition.mode, window=f.repetition.window, prob_threshold=f.repetition.prob_threshold
        ),
        make_filter("overlong", mode=f.overlong.mode),
    ]


def post_batch_filters(config: RunConfig, check_staleness: bool = True) -> list[RolloutFilter]:
    """The staleness bound; off when no trainer publishes weights (the policy never changes)."""
    if not check_staleness:
        return []
    return [make_filter("stale", max_off_policy_steps=config.off_policy.max_off_policy_steps)]


def batch_builder(config: RunConfig, next_step: int, check_staleness: bool = True) -> BatchBuilder:
    b = config.batch
    cutter = BatchCutter(rollouts_per_step=None if b.token_budget else b.rollouts_per_step, token_budget=b.token_budget)
    return BatchBuilder(
        cutter, b.seq_len, b.trainer_ranks, post_batch_filters(config, check_staleness), next_step=next_step
    )


def sampling_params(config: RunConfig, envs: dict[str, Environment]) -> dict[str, SamplingParams]:
    inf = config.inference
    return {
        name: SamplingParams(
            max_tokens=inf.max_tokens, temperature=inf.temperature, stop_token_ids=tuple(env.stop_token_ids())
        )
        for name, env in envs.items()
    }


def checkpoint_validator(config: RunConfig) -> Callable[[Path], object]:
    """Checks a published checkpoint against the policy model's tensor names and shapes."""
    return functools.partial(
        validate_checkpoint, reference_model_dir=model_dir(config), lora=config.trainer.lora is not None
    )


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
        raise ValueError(
            f"inference.api_key_env names the environment variable {name}, which is not set "
            "(or empty): export the servers' API key in it"
        )
    return key


def inference_client(config: RunConfig, url: str, key: str | None, version: int = 0) -> InferenceClient:
    """The client of one inference server, as the run's config sets it up."""
    inf = config.inference
    return InferenceClient(
        url,
        model=config.model.name,
        timeout_s=inf.request_timeout_s,
        max_retries=inf.max_retries,
        backoff_s=inf.retry_backoff_s,
        stream=inf.stream,
        stream_interval=config.stream_interval,
        api_key=key,
        ca_bundle=inf.ca_bundle,
        version=version,
        route=inf.route,
        lora=config.trainer.lora is not None,
        vocab_size=vocab_size(config),
        max_response_bytes=inf.max_response_mb << 20,
    )


def dispatcher_thread(
    config: RunConfig,
    server_urls: list[str],
    envs: dict[str, Environment],
    policy_version: Callable[[], int],
    max_inflight: int | None = None,
    start_cap: int | None = None,
) -> DispatcherThread:
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
        return Dispatcher(
            clients,
            envs,
            modes,
            sampling,
            ceiling,
            policy_version,
            emit,
            seed=config.run.seed,
            max_redispatches=inf.max_redispatches,
            max_regenerations=config.off_policy.max_regenerations,
            stale_rule=config.off_policy.stale_rule,
            restore=restore,
            concurrency=concurrency_for(config, ceiling, start_cap),
            max_off_policy_steps=config.off_policy.max_off_policy_steps,
            max_context=config.model.max_context,
        )

    return DispatcherThread(
        build,
        abandoned_after_s=ABANDONED_SOURCE_S,
        connect=lambda url: inference_client(config, url, key),
        drain_timeout_s=inf.drain_timeout_s,
    )


def concurrency_for(config: RunConfig, ceiling: int, start_cap: int | None = None) -> ConcurrencyController:
    """The in-flight controller of one shard's dispatcher holding `ceiling` permits."""
    c = config.dispatch.concurrency
    start = start_cap if start_cap is not None else c.start  # the controller holds it within [1, ceiling]
    return concurrency_controller(c.mode, ceiling, start=start, kv_soft_cap=c.kv_soft_cap)


class StartDispatcher(Protocol):
    """`dispatcher_thread` with the config given: a dispatcher on its own thread over `server_urls`."""

    def __call__(
        self,
        server_urls: list[str],
        envs: dict[str, Environment],
        policy_version: Callable[[], int],
        max_inflight: int | None = None,
        start_cap: int | None = None,
    ) -> DispatcherThread: ...


# -- the bundles each stage keeps -------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchParts:
    """What the dispatch step keeps (built once in its `setup`): the environments, the prompt schedules,
    how to start a dispatcher and how to check published weights; `source` builds a shard's source from
    them, with the parts that the shard and the run directory as it is now decide."""

    spec: SourceSpec
    envs: dict[str, Environment]
    schedule: PromptSchedule
    eval_schedule: PromptSchedule | None  # None: the run does not evaluate
    dispatcher_thread: StartDispatcher
    validate_checkpoint: Callable[[Path], object]  # raises for a bad checkpoint

    def source(self, shard: Shard, restored: DispatchRange) -> RolloutSource:
        """Shard `shard`'s source, restored from its restriction (built again after every restore)."""
        return RolloutSource(self.spec, shard, restored, self.source_parts(shard))

    def source_parts(self, shard: Shard) -> SourceParts:
        """A shard's parts as the committed steps find them: the curriculum and the mix follow the committed
        windows, the servers are the fleet's (or the shard's share of the configured ones), and the
        concurrency controller starts where the last committed steps show it was."""
        spec, config, inf = self.spec, self.spec.config, self.spec.config.inference
        run_dir = RunDir(spec.run_dir)
        commits = CommittedSteps(run_dir)
        curriculum = Curriculum.for_run(config)  # rebuilt from the committed windows, as on every restart
        mix = EnvMix.for_run(config, shard.count)  # None: one stream, environments taking turns
        for follower in (curriculum, mix):
            if follower is not None:
                follower.follow(run_dir, commits.last_step)
        # A living fleet (inference.discovery "file" or "dns"): the servers fleet.json deals this shard.
        fleet = FleetFollower(run_dir.fleet_path, shard.index) if inf.discovery != "static" else None
        servers = fleet.changed(time.time()) if fleet is not None else None
        if servers is None:
            servers = shard.servers(list(spec.server_urls))
        permits = shard.permits(inf.max_inflight)
        start_cap = _committed_start_cap(config, run_dir, commits.last_step, servers)
        errors = ErrorTally()
        return SourceParts(
            envs=self.envs,
            schedule=self.schedule,
            run_dir=run_dir,
            commits=commits,
            curriculum=curriculum,
            mix=mix,
            fleet_changes=fleet.changed if fleet is not None else None,
            permits=permits,
            limits=limits_for(
                config.batch.rollouts_per_step,
                min(e.group_size for e in config.envs),
                permits,
                config.off_policy.max_async_level,
                spec.with_trainer,
                shard.count,
                max_off_policy_steps=config.off_policy.max_off_policy_steps,
            ),
            evals=EvalRounds(config.eval, self.eval_schedule, shard, commits.last_step),
            status=StatusBoard(run_dir, shard.index),
            servers_down=ServersDownWatch(servers, inf.all_servers_down_timeout_s, inf.startup_timeout_s),
            errors=errors,
            progress=ProgressWatch(
                config.run.stop_after_errored_groups, config.run.stop_after_failing_s, errors, time.monotonic()
            ),
            start_dispatcher=lambda policy_version: self.dispatcher_thread(
                servers, self.envs, policy_version, permits, start_cap
            ),
            weight_sync=lambda update: WeightSync(run_dir, update=update, validate=self.validate_checkpoint),
        )


def _committed_start_cap(config: RunConfig, run_dir: RunDir, last_step: int, servers: list[str]) -> int | None:
    """Where the concurrency controller was, as far as the committed steps show: a restart does not
    slow-start from scratch, and nothing of it lives only in a worker's memory (None: its configured start)."""
    if config.dispatch.concurrency.mode == "fixed" or not last_step:
        return None
    windows = [run_dir.read_window(s) for s in range(max(1, last_step - 1), last_step + 1)]
    return committed_concurrency(windows, set(servers))


def dispatch_parts(spec: SourceSpec) -> DispatchParts:
    """The dispatch step's bundle: every shard's source on this worker is built from it."""
    envs = build_envs(spec.config)
    return DispatchParts(
        spec=spec,
        envs=envs,
        schedule=build_schedule(spec.config, envs),
        eval_schedule=eval_schedule(spec.config, envs) if spec.config.eval.every_steps else None,
        dispatcher_thread=functools.partial(dispatcher_thread, spec.config),
        validate_checkpoint=checkpoint_validator(spec.config),
    )


def group_scoring(config: RunConfig) -> GroupScoring:
    """How every group of the run is scored: the Score step's rules, and replay's."""
    return GroupScoring(
        algorithms=algorithms(config),
        pre_filters=pre_batch_filters(config),
        temperature=config.inference.temperature,
        min_scored={e.name: e.min_scored for e in config.envs},
    )


@dataclass(frozen=True)
class ScoringParts:
    """What the Score step keeps: the environments (their rewards) and how a group is scored."""

    envs: dict[str, Environment]
    scoring: GroupScoring


def scoring_parts(config: RunConfig) -> ScoringParts:
    return ScoringParts(envs=build_envs(config), scoring=group_scoring(config))


@dataclass(frozen=True)
class PackingParts:
    """What the packing step keeps: how to start an empty batch builder at a step."""

    batch_builder: Callable[[int], BatchBuilder]  # (the step it cuts next) -> a builder holding no group


def packing_parts(config: RunConfig, check_staleness: bool = True) -> PackingParts:
    return PackingParts(batch_builder=functools.partial(batch_builder, config, check_staleness=check_staleness))


@dataclass(frozen=True)
class EvalParts:
    """What the Evaluate step keeps: how many held-out groups make a round."""

    prompts_per_round: int


def eval_parts(config: RunConfig) -> EvalParts:
    return EvalParts(prompts_per_round=len(eval_schedule(config, build_envs(config))))


@dataclass(frozen=True)
class JobParts:
    """What the job keeps for a run (built once where a run starts): the servers' API key, the clients of
    its start-up checks, and the prompt schedule whose size every shard's restriction is cut from."""

    config: RunConfig
    api_key: str | None
    schedule: PromptSchedule

    def client(self, url: str) -> InferenceClient:
        return inference_client(self.config, url, self.api_key)


def job_parts(config: RunConfig) -> JobParts:
    return JobParts(config=config, api_key=api_key(config), schedule=build_schedule(config, build_envs(config)))


def replay_parts(run_dir: RunDir, config: RunConfig | None = None, check_staleness: bool | None = None) -> ReplayParts:
    """What replaying a run's committed steps needs: its config (`config`, else its config.json), how it
    scored groups, and its packer (checking staleness as the run did: `check_staleness`, else as far as the
    run directory tells)."""
    config = run_config(run_dir, config)
    checked = staleness_checked(run_dir) if check_staleness is None else check_staleness
    return ReplayParts(
        config=config, scoring=group_scoring(config), batch_builder=packing_parts(config, checked).batch_builder
    )
