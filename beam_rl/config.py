"""The run configuration: one pydantic model, loaded from TOML, that every layer reads its settings from."""

from __future__ import annotations

import difflib
import math
import re
import string
import tomllib
import types
import urllib.parse
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

FilterMode = Literal["off", "monitor", "enforce"]


class ConfigError(ValueError):
    """A config that cannot be used; `problems` holds (key path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        entries = [f"{path}: {msg}" if path else msg for path, msg in problems]
        if len(entries) == 1:  # one line, as every other error the command prints
            super().__init__(f"invalid config {source}: {entries[0]}")
        else:
            super().__init__("\n".join([f"invalid config {source}:", *(f"  {e}" for e in entries)]))


# A URL's user-info (scheme://user:password@host): a config is written whole to the run directory
# (config.json) and to every tracker, so a key in it would be too. Keys live in environment variables that
# an `api_key_env` setting names; a URL carrying one is refused wherever the config holds it.
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]*@")


def has_credentials(text: str) -> bool:
    """Whether `text` is a URL with user-info (`http://user:secret@host`)."""
    return _URL_USERINFO.match(text.strip()) is not None


def _credential_problems(
    value: Any,
    loc: tuple[str | int, ...] = (),
    table: dict[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """(key path, message) of every string under `value`, a raw config at `loc` (in `table`, the TOML table
    that holds it), that is a URL with credentials. The message never quotes the URL: it holds the secret."""
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _credential_problems(item, (*loc, key), value)]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _credential_problems(item, (*loc, i), table)]
    if not isinstance(value, str) or not has_credentials(value):
        return []
    section = loc[:-1] if isinstance(loc[-1], str) else loc[:-2]
    problem = "a URL with credentials (user:password@) would be written to the run directory"
    if "api_key_env" not in _allowed_keys(section):  # an env's args, say: no key setting of its own
        return [(_key_path(loc), f"{problem}: pass the key in an environment variable instead")]
    setting = _key_path((*section, "api_key_env"))
    if table and table.get("api_key_env"):  # aiohttp refuses both at the first request, minutes into the run
        return [(_key_path(loc), f"credentials in the URL conflict with {setting}: take user:password@ out of it")]
    return [(_key_path(loc), f"{problem}: put the key in an environment variable and name it in {setting}")]


class _Section(BaseModel):
    # Unknown keys are almost always typos of a real key; silently ignoring them runs the wrong job.
    # Strict: TOML has real types, so `seq_len = "1024"` or `seed = true` is a mistake, not a value.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


class RunSection(_Section):
    dir: Path = Field(Path("runs/tiny"), strict=False)  # TOML and config.json give a string
    seed: int = 0
    max_steps: int = Field(10, gt=0)
    bad_rows: Literal["fail", "skip"] = "fail"  # a malformed dataset row: stop the run, or skip and count it
    # A run nothing can train stops, naming its most frequent error (0: never): when every rollout of this many
    # consecutive groups errored, or when no step has committed for this many seconds while at least half of
    # the rollouts finished since errored (beam_rl/source/status.py:ProgressWatch).
    stop_after_errored_groups: int = Field(16, ge=0)
    stop_after_failing_s: float = Field(600.0, ge=0)


class ModelSection(_Section):
    name: str = Field("tiny", min_length=1)  # "tiny" (built in) or a local Hugging Face model directory
    max_context: int = Field(512, gt=0)  # prompt + every turn of a trajectory must fit


class InferenceSection(_Section):
    urls: list[str] = Field(default_factory=list)  # vLLM base URLs; empty = start embedded servers
    embedded_servers: int = Field(2, ge=0)
    embedded_max_num_seqs: int = Field(64, gt=0)
    embedded_mode: Literal["model", "instant", "simulated"] = "model"
    max_inflight: int = Field(128, gt=0)  # permits: the hard cap on in-flight rollouts
    request_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(2, ge=0)
    retry_backoff_s: float = Field(0.2, ge=0)
    # At start-up every server must answer a one-token request within this many seconds, or the run
    # does not start (naming it); a server that was up and went down is waited for longer (below).
    startup_timeout_s: float = Field(30.0, gt=0)
    # With every server unhealthy the run waits (re-probing them); past this many seconds it stops.
    all_servers_down_timeout_s: float = Field(300.0, gt=0)
    max_tokens: int = Field(24, gt=0)
    temperature: float = Field(1.0, ge=0)
    # Tokens come back as they are sampled (server-sent events): a failed server's rollouts continue from
    # them elsewhere, and "keep" updates know which tokens each policy version sampled (docs/weight-updates.md).
    stream: bool = True
    # Streamed tokens come in chunks of this many (vLLM 0.32's per-request `stream_interval`; a choice's first
    # token and its end come at once): the dispatcher parses an event a chunk, not a token (docs/scale.md).
    # Keep updates on the completions route stream a token an event all the same: vLLM holds a partial
    # chunk through the pause, where the cut cannot be seen (docs/weight-updates.md).
    stream_interval: int = Field(16, ge=1)
    # completions: OpenAI's /v1/completions, served by any vLLM. generate: vLLM 0.32's token-in/token-out
    # /inference/v1/generate (`vllm serve --enable-scale-out`), whose answers name the weights that sampled
    # every token: "keep" updates need no drain, and unstreamed requests know their versions too.
    route: Literal["completions", "generate"] = "completions"
    # A rollout whose server fails (refused, reset, 5xx after retries, timeout, death mid-request) moves to
    # another healthy server this many times, with its group; then it is an errored rollout.
    max_redispatches: int = Field(3, ge=0)
    # The most of one server answer held in memory, MiB: a whole body, or one event of a stream. A server
    # sending more is sick (InferenceCorruptResponse, counted against it). 256: about twice the
    # non-streamed answer of n=64 choices of 32k tokens with their logprobs.
    max_response_mb: int = Field(256, gt=0)
    # The name of the environment variable holding the servers' API key (vLLM's --api-key); the key itself
    # never goes in a config, a log or the run directory.
    api_key_env: str | None = Field(None, min_length=1)
    ca_bundle: Path | None = Field(None, strict=False)  # PEM file of the CA that signed https servers' certificates
    # Where the fleet comes from while the run goes on (docs/fleet.md). static: `urls` (or the embedded
    # servers), fixed. file: the run directory's `servers` file, seeded with those and edited by `beam-rl
    # servers add|remove`. dns: every A/AAAA record of `dns_name`'s host, as a Kubernetes headless service gives.
    discovery: Literal["static", "file", "dns"] = "static"
    # With discovery = "dns": the servers' base URL with the service's name as host, "http://vllm.ns.svc:8000".
    dns_name: str | None = None
    dns_resolver: str | None = None  # "host:port" of the nameserver to ask; None: the system's
    discovery_interval_s: float = Field(5.0, gt=0)  # how often the fleet is discovered again
    # A server leaving the fleet takes no new group; what it still runs after this long moves, with the
    # tokens it streamed, to another server.
    drain_timeout_s: float = Field(60.0, ge=0)

    @field_validator("urls")
    @classmethod
    def _http_base_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) base URL")
        # Clients append "/v1/completions"; a trailing slash would double it.
        return [url.rstrip("/") for url in urls]

    @field_validator("dns_name")
    @classmethod
    def _dns_base_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{url!r} is not an http(s) base URL whose host is the name to resolve")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _discovery_source(self) -> InferenceSection:
        if self.discovery == "dns" and self.dns_name is None:
            raise ValueError("discovery = \"dns\" needs dns_name, the servers' base URL with the name to resolve")
        if self.discovery != "dns" and self.dns_name is not None:
            raise ValueError(f"dns_name is set but discovery = {self.discovery!r}: set discovery = \"dns\"")
        return self

    @field_validator("ca_bundle")
    @classmethod
    def _existing_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"{str(path)!r} is not a file (a PEM bundle of CA certificates)")
        return path


class JudgeVerdict(_Section):
    """How a judge's answer becomes a reward: the last match of `pattern` (a regex with one group) in the
    answer; its group is the reward as a number, or with `labels`, a label looked up there (case and
    surrounding spaces ignored)."""

    pattern: str = Field(min_length=1)
    labels: dict[str, float] | None = Field(None, min_length=1)

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as err:
            raise ValueError(f"not a regular expression: {err}") from None
        if groups != 1:
            raise ValueError(f"needs exactly one group (the verdict), has {groups}")
        return pattern

    @field_validator("labels")
    @classmethod
    def _distinct_labels(cls, labels: dict[str, float] | None) -> dict[str, float] | None:
        if labels is None:
            return None
        folded = [label.strip().lower() for label in labels]
        if "" in folded or len(set(folded)) != len(folded):
            raise ValueError(f"labels must be non-empty and distinct ignoring case and spaces, got {list(labels)}")
        if not all(math.isfinite(score) for score in labels.values()):
            raise ValueError(f"every label's score must be finite, got {labels}")
        return labels


class JudgeSection(_Section):
    """An LLM judge that replaces the environment's reward: any OpenAI-compatible chat endpoint
    (beam_rl/scoring/judge.py, docs/environments.md)."""

    url: str  # base URL; the judge posts to <url>/v1/chat/completions
    model: str = Field(min_length=1)
    # The user message: `{completion}` (the env's final text) and the row's fields by name, str.format style.
    prompt: str = Field(min_length=1)
    system: str | None = None  # an optional system message before it
    verdict: JudgeVerdict
    api_key_env: str | None = Field(None, min_length=1)  # name of the environment variable with the API key
    timeout_s: float = Field(30.0, gt=0)  # one request; reward.timeout_s bounds the whole reward, retries included
    max_retries: int = Field(2, ge=0)  # connection errors, HTTP 408, 429 and 5xx
    retry_backoff_s: float = Field(0.5, ge=0)  # doubled after every retry
    max_tokens: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0)

    @field_validator("url")
    @classmethod
    def _http_base_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) base URL")
        return url.rstrip("/")

    @field_validator("prompt")
    @classmethod
    def _names_the_completion(cls, prompt: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(prompt) if name is not None}
        except ValueError as err:
            raise ValueError(f"not a str.format template: {err} (write literal braces as {{{{ and }}}})") from None
        if "completion" not in fields:
            raise ValueError("must contain {completion}: the judge would not see what it grades")
        if "" in fields or any(name.isdigit() for name in fields):
            raise ValueError("fields must be named ({completion}, {question}, ...), not positional")
        return prompt


class RewardSection(_Section):
    """How the scoring stage runs an environment's reward, per scoring worker process."""

    concurrency: int = Field(64, gt=0)  # async rewards in flight at once (sync ones run inline, one at a time)
    # One async reward call; past it the rollout is a reward_error (an infrastructure failure, not a 0).
    timeout_s: float = Field(60.0, gt=0)
    # A group with fewer ok rollouts than this after rewarding is not trained (flagged "too_few_scored").
    # Unset: 2 (one rollout has no baseline), or the group size when that is 1.
    min_scored: int | None = Field(None, ge=1)
    judge: JudgeSection | None = None  # set: an LLM judge replaces the environment's own reward


def shards_problem(shards: int, servers: int) -> str | None:
    """What is wrong with `shards` dispatch shards over `servers` inference servers (each shard drives
    servers of its own), or None."""
    if servers < shards:
        return f"{shards} shards need at least as many inference servers; there are {servers}"
    return None


class CurriculumSection(_Section):
    """Which prompts get another epoch, from their committed groups' rewards (beam_rl/source/curriculum.py)."""

    easy_threshold: float = Field(1.0, ge=0, le=1)  # a group whose every reward is at least this: solved
    hard_threshold: float = Field(0.0, ge=0, le=1)  # a group whose every reward is at most this: unsolved
    solved_every: int = Field(0, ge=0)  # a solved prompt is sent again every N-th epoch; 0: retired
    unsolved_every: int = Field(1, ge=1)  # an unsolved one every N-th epoch; 1: every epoch
    shuffle: bool = True  # each epoch visits the rows in an order of its own, drawn from run.seed

    @model_validator(mode="after")
    def _thresholds_apart(self) -> CurriculumSection:
        if self.hard_threshold >= self.easy_threshold:
            raise ValueError(
                f"hard_threshold ({self.hard_threshold}) must be below easy_threshold ({self.easy_threshold})"
            )
        return self


class EnvConfig(_Section):
    name: str = Field(min_length=1)  # this entry's name in the run: group ids, metrics, the rollouts' env
    # Which environment class: a built-in name, an entry point of the `beam_rl.environments` group, or an
    # import path "package.module:Class". Unset: `name` is the kind (set, one kind can run twice under
    # two names with different `args`).
    kind: str | None = Field(None, min_length=1)
    group_size: int = Field(8, ge=1)
    algorithm: str = Field("grpo", min_length=1)
    algorithm_args: dict[str, Any] = Field(default_factory=dict)
    args: dict[str, Any] = Field(default_factory=dict)  # passed to the environment's constructor
    mode: Literal["group", "rollout"] = "group"  # group: one request with n=group_size; rollout: one per attempt
    epochs: int = Field(1, ge=1)
    max_turns: int = Field(4, ge=1)
    split: str = Field("train", min_length=1)
    limit: int | None = Field(None, gt=0)  # use only the first `limit` rows of the split
    reward: RewardSection = Field(default_factory=RewardSection)
    curriculum: CurriculumSection | None = None  # unset: every prompt every epoch, in row order
    # Its share of what trains (dispatch.mix_by), relative to the other environments' ratios: set on every
    # environment or on none (none: they take turns, row by row). beam_rl/source/mixing.py.
    ratio: float | None = Field(None, gt=0)

    @property
    def min_scored(self) -> int:
        """reward.min_scored with its default filled in."""
        if self.reward.min_scored is not None:
            return self.reward.min_scored
        return min(2, self.group_size)


class BatchSection(_Section):
    rollouts_per_step: int = Field(64, gt=0)
    token_budget: int | None = Field(None, gt=0)  # cut a batch by trainable tokens instead of rollouts
    seq_len: int = Field(1024, gt=0)  # tokens per micro-batch
    trainer_ranks: int = Field(1, ge=1)


class ZeroAdvantageFilter(_Section):
    mode: FilterMode = "enforce"


class GibberishFilter(_Section):
    """arXiv 2510.02387 sec. 5.2: id > token_id_frac * vocab_size and logprob < -log(vocab_size) - logprob_offset.

    0.9 keeps to "near the top of the vocabulary"; prime-rl's absolute 100_000 is 0.66 of Qwen's vocab.
    """

    mode: FilterMode = "monitor"
    token_id_frac: float = Field(0.9, gt=0, lt=1)
    logprob_offset: float = Field(2.0, ge=0)


class RepetitionFilter(_Section):
    """arXiv 2506.13585 sec. 3.2: `window` consecutive sampled tokens each with probability > prob_threshold."""

    mode: FilterMode = "monitor"
    window: int = Field(1000, ge=1)
    prob_threshold: float = Field(0.99, gt=0, lt=1)


class OverlongFilter(_Section):
    mode: FilterMode = "monitor"


class FiltersSection(_Section):
    zero_advantage: ZeroAdvantageFilter = Field(default_factory=ZeroAdvantageFilter)
    gibberish: GibberishFilter = Field(default_factory=GibberishFilter)
    repetition: RepetitionFilter = Field(default_factory=RepetitionFilter)
    overlong: OverlongFilter = Field(default_factory=OverlongFilter)


class OffPolicySection(_Section):
    max_async_level: int = Field(1, ge=0)  # how many steps the source may run ahead of the trainer
    max_off_policy_steps: int = Field(2, ge=0)  # hard staleness bound (by a rollout's oldest token) before packing
    # A rollout still generating when new weights put its oldest token past the bound is generated again
    # under the new policy, at most this many times; then it is cancelled (0: cancelled at once).
    max_regenerations: int = Field(2, ge=0)
    # What happens to work new weights put past the bound while it generates: "regenerate" (above), or
    # "cancel_group": every group whose first rollout started too long ago is cancelled whole (the rule
    # before regeneration, bench/recovery/goodput.py's baseline).
    stale_rule: Literal["regenerate", "cancel_group"] = "regenerate"


class WeightsSection(_Section):
    """How inference servers take the weights the trainer publishes (docs/weight-updates.md)."""

    # reload: load while requests run (no pause; tokens of requests spanning it have unknown versions);
    # keep: pause with requests frozen, load, resume (they continue on the new weights);
    # continue: abort requests keeping their tokens, load, resume them as prompt + partial completion.
    update_mode: Literal["reload", "keep", "continue"] = "keep"
    # keep, servers on other machines: the drain before the resume first waits until no stream has received
    # a token for this long (bytes the server sent before answering the pause may still be on their way);
    # servers on this machine need no such margin (docs/weight-updates.md).
    drain_quiet_s: float = Field(0.005, ge=0)
    update_timeout_s: float = Field(600.0, gt=0)  # one server's whole update (pause, load, resume)


class ConcurrencySection(_Section):
    # How many rollouts each shard keeps in flight (beam_rl/dispatch/concurrency.py): "fixed" holds
    # inference.max_inflight; "goodput" chooses the cap that trains the most tokens per second, "kv" keeps
    # the servers' KV-cache usage under kv_soft_cap; both stay under inference.max_inflight.
    mode: Literal["fixed", "goodput", "kv"] = "fixed"
    start: int | None = Field(None, gt=0)  # goodput and kv: the first cap (None: a quarter of the ceiling, kv half)
    kv_soft_cap: float = Field(0.9, gt=0, le=1)


class DispatchSection(_Section):
    # The dispatch source as this many elements: each shard owns every shards-th prompt, every
    # shards-th inference server and its share of the permits, so dispatch spreads over workers.
    shards: int = Field(1, ge=1)
    concurrency: ConcurrencySection = Field(default_factory=ConcurrencySection)
    mix_by: Literal["samples", "tokens"] = "samples"  # what envs[].ratio shares: trained samples or their tokens
    # A runner checkpoint keeps the tokens of the rollouts in flight, so a restored worker continues them
    # from there (beam_rl/dispatch/resume.py); false: they start again from their prompts.
    checkpoint_tokens: bool = True


class RunnerSection(_Section):
    name: Literal["direct", "flink-local", "flink"] = "direct"
    flink_master: str | None = None  # host:port of a Flink cluster's REST endpoint
    # Where the Python stages run: "loopback" in this process, "external" in Beam worker pools beside the
    # cluster's TaskManagers, "process" as workers the runner starts (each TaskManager's; on direct, one beside
    # Prism). None: loopback for direct and flink-local, external for flink (docs/flink-cluster.md).
    environment: Literal["loopback", "external", "process"] | None = None
    worker_pool: str = "localhost:50000"  # external: the worker pool's address as each TaskManager sees it
    # Where the ports the run opens for its runner listen (Prism's job service and its workers' endpoints, the
    # LOOPBACK worker pool, the Flink job server): loopback; another address (or "0.0.0.0") opens them to
    # whoever reaches it, with a warning per port: they run the code they are sent.
    bind_host: str = Field("127.0.0.1", min_length=1)
    # process: the command the runner starts a worker with (None: this machine's `runners.workers boot`)
    worker_command: str | None = None
    parallelism: int = Field(1, ge=1)
    checkpointing_interval_ms: int | None = Field(None, gt=0)
    state_backend: Literal["rocksdb", "hashmap", "filesystem"] | None = None  # Beam's FlinkPipelineOptions values
    state_backend_storage_path: str | None = None
    # flink-local's JVM heap (job server, embedded cluster, keyed state), MB. None: 512 plus four
    # steps of samples. Unbounded, G1 grew it through a whole run (RSS +11% over 20k rollouts).
    flink_local_heap_mb: int | None = Field(None, ge=256)


class LoraSection(_Section):
    """A LoRA adapter trained in place of the whole model (peft): each step publishes the adapter alone, and
    the servers load it as a LoRA adapter of its own version (docs/lora.md)."""

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    # Module names of the model (the last part of a Linear's path: "q_proj"), each of which must exist.
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)


class TrainerSection(_Section):
    kind: Literal["reference", "none"] = "reference"  # none: an external trainer reads the run directory
    lr: float = Field(1e-3, gt=0)  # AdamW, constant
    weight_decay: float = Field(0.0, ge=0)
    # The PPO ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]; DAPO's clip-higher raises only the top.
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    clip_eps_high: float = Field(0.2, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)  # global gradient-norm clip before each optimizer step
    threads: int = Field(1, ge=1)  # torch CPU threads; 1 leaves the cores to the servers and the pipeline
    # Data-parallel ranks (gloo), each reading its own rank file (beam_rl/trainer/data_parallel.py); more
    # than 1 must equal batch.trainer_ranks. 1: one process stands in for every rank.
    nproc: int = Field(1, ge=1)
    # Where the trainer computes: "cpu", or a CUDA device ("cuda", "cuda:1"; data-parallel ranks then use NCCL,
    # each on the device of its LOCAL_RANK). bfloat16 halves memory and is the usual choice on a GPU.
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: LoraSection | None = None  # train a LoRA adapter instead of every weight


class EvalSection(_Section):
    every_steps: int = Field(0, ge=0)  # 0 = no evaluation
    samples_per_prompt: int = Field(1, ge=1)  # rollouts per held-out prompt (pass@1 averages them)
    limit: int | None = Field(None, gt=0)  # held-out prompts per environment (None = the whole split)


class WandbLogging(_Section):
    """Weights & Biases: "offline" writes under <run dir>/wandb/ only (upload later with `wandb sync`)."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = Field("beam-rl", min_length=1)
    entity: str = ""  # "" = the account's default entity
    run_name: str = ""  # "" = the run directory's name


class TensorBoardLogging(_Section):
    enabled: bool = False  # event files under <run dir>/tensorboard/


class LoggingSection(_Section):
    """Where a run's figures go besides metrics.jsonl: experiment trackers and a Prometheus endpoint."""

    wandb: WandbLogging = Field(default_factory=WandbLogging)
    tensorboard: TensorBoardLogging = Field(default_factory=TensorBoardLogging)
    prometheus_port: int = Field(0, ge=0, le=65535)  # the orchestrator serves /metrics here; 0 = off
    # Loopback; "0.0.0.0" lets a Prometheus on another host scrape (a warning says so).
    prometheus_host: str = Field("127.0.0.1", min_length=1)


class _CrossFieldErrors(ValueError):
    """Raised by RunConfig's model validator so each problem keeps its own key path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


class RunConfig(_Section):
    """The whole run. Defaults describe the tiny CPU run.

    Relative paths (`run.dir`, a local `model.name`) are relative to the current working directory, not
    to the config file, so a config run from the repo root writes under `./runs/`, like every other
    path given on the command line. `model_dump(mode="json")` is what the run directory stores.
    """

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    inference: InferenceSection = Field(default_factory=InferenceSection)
    dispatch: DispatchSection = Field(default_factory=DispatchSection)
    envs: list[EnvConfig] = Field(min_length=1)
    batch: BatchSection = Field(default_factory=BatchSection)
    filters: FiltersSection = Field(default_factory=FiltersSection)
    off_policy: OffPolicySection = Field(default_factory=OffPolicySection)
    weights: WeightsSection = Field(default_factory=WeightsSection)
    runner: RunnerSection = Field(default_factory=RunnerSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        # Before the fields are read: their own errors would quote the URL, and with it the secret.
        problems = _credential_problems(data) if isinstance(data, dict) else []
        if problems:
            raise _CrossFieldErrors(problems)
        return data

    @property
    def stream_interval(self) -> int:
        """The chunk size clients ask servers to stream: `inference.stream_interval`, but 1 under keep updates on
        the completions route, where a chunk could hold tokens of both sides of a pause unseen."""
        if self.weights.update_mode == "keep" and self.inference.route == "completions":
            return 1
        return self.inference.stream_interval

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        from beam_rl.scoring.advantages import algorithm_problems  # the registry: here, not when config is imported

        problems: list[tuple[str, str]] = []
        batch, inference = self.batch, self.inference
        seen: dict[str, int] = {}
        for i, env in enumerate(self.envs):
            problems += [
                (f"envs[{i}].{key}", msg) for key, msg in algorithm_problems(env.algorithm, env.algorithm_args)
            ]
            if env.name in seen:
                problems.append((f"envs[{i}].name", f"duplicate {env.name!r} (also envs[{seen[env.name]}])"))
            seen.setdefault(env.name, i)
            if env.reward.min_scored is not None and env.reward.min_scored > env.group_size:
                problems.append(
                    (
                        f"envs[{i}].reward.min_scored",
                        f"{env.reward.min_scored} is above envs[{i}].group_size ({env.group_size}): "
                        "no group could ever be trained",
                    )
                )
            # Batches are cut on whole groups, so a step must hold a whole number of every env's groups.
            if batch.rollouts_per_step % env.group_size:
                problems.append(
                    (
                        "batch.rollouts_per_step",
                        f"{batch.rollouts_per_step} is not a multiple of envs[{i}].group_size "
                        f"({env.group_size}, env {env.name!r})",
                    )
                )
            # A group-mode request holds group_size permits at once; fewer permits (a shard's share of
            # them) would never admit it.
            shard_permits = inference.max_inflight // self.dispatch.shards
            if env.mode == "group" and env.group_size > shard_permits:
                problems.append(
                    (
                        "inference.max_inflight",
                        f"{inference.max_inflight} permits ({shard_permits} per dispatch shard) cannot admit a group "
                        f"of envs[{i}].group_size ({env.group_size}) in group mode",
                    )
                )
        with_ratio = [i for i, env in enumerate(self.envs) if env.ratio is not None]
        if with_ratio and len(with_ratio) < len(self.envs):
            missing = next(i for i in range(len(self.envs)) if i not in with_ratio)
            problems.append(
                (
                    f"envs[{missing}].ratio",
                    f"unset, but envs[{with_ratio[0]}].ratio is set: set a ratio on every environment or on none",
                )
            )
        if self.trainer.nproc > 1 and self.trainer.nproc != batch.trainer_ranks:
            problems.append(
                (
                    "trainer.nproc",
                    f"{self.trainer.nproc} ranks, but batch.trainer_ranks = {batch.trainer_ranks} rank files a step",
                )
            )
        off = self.off_policy
        if off.max_off_policy_steps < off.max_async_level:
            problems.append(
                (
                    "off_policy.max_off_policy_steps",
                    f"{off.max_off_policy_steps} is below off_policy.max_async_level ({off.max_async_level}): "
                    "every rollout the source runs ahead would be dropped as stale",
                )
            )
        if not inference.urls and inference.embedded_servers == 0 and inference.discovery == "static":
            problems.append(("inference.embedded_servers", "0 with no inference.urls leaves no server to generate"))
        if inference.max_tokens >= self.model.max_context:
            problems.append(
                (
                    "inference.max_tokens",
                    f"{inference.max_tokens} leaves no room for a prompt in model.max_context ({self.model.max_context})",
                )
            )
        # A sample is a whole trajectory (up to max_context tokens) and is never split across micro-batches.
        if batch.seq_len < self.model.max_context:
            problems.append(
                (
                    "batch.seq_len",
                    f"{batch.seq_len} is below model.max_context ({self.model.max_context}): "
                    "a long trajectory could not be packed",
                )
            )
        servers = len(inference.urls) or inference.embedded_servers
        if (
            inference.discovery == "static"
            and servers > 0
            and (problem := shards_problem(self.dispatch.shards, servers))
        ):
            problems.append(("dispatch.shards", problem))
        if self.dispatch.shards > inference.max_inflight:
            problems.append(
                (
                    "dispatch.shards",
                    f"{self.dispatch.shards} shards cannot share "
                    f"inference.max_inflight = {inference.max_inflight} permits",
                )
            )
        runner = self.runner
        if runner.name == "flink" and not runner.flink_master:
            problems.append(("runner.flink_master", 'required when runner.name = "flink" (host:port of the cluster)'))
        if runner.name == "flink" and runner.flink_master == "[local]":
            problems.append(("runner.flink_master", '"[local]" is an embedded Flink: use runner.name = "flink-local"'))
        if runner.state_backend and not runner.state_backend_storage_path:
            problems.append(
                ("runner.state_backend_storage_path", f"required when runner.state_backend = {runner.state_backend!r}")
            )
        if problems:
            raise _CrossFieldErrors(problems)
        return self

    @property
    def worker_environment(self) -> str:
        """runner.environment with its default filled in."""
        if self.runner.environment is not None:
            return self.runner.environment
        return "external" if self.runner.name == "flink" else "loopback"

    def env(self, name: str) -> EnvConfig:
        for env in self.envs:
            if env.name == name:
                return env
        raise KeyError(f"no environment {name!r} in config (have {[e.name for e in self.envs]})")


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run config; any problem raises ConfigError naming the file and key."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(path), [("", "file not found")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [("", f"not valid TOML: {exc}")]) from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib decodes the whole file first
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(str(path), [("", f"not valid UTF-8 (line {line})")]) from None
    except OSError as exc:  # a directory, no permission, an I/O error
        raise ConfigError(str(path), [("", f"unreadable: {exc.strerror or exc}")]) from None
    return config_from_dict(data, source=str(path))


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate an already-parsed config (e.g. a run directory's config.json, or a test's dict)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _problems(exc)) from None


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _CrossFieldErrors):
            problems.extend(cause.problems)
            continue
        loc = err["loc"]
        path = _key_path(loc)
        if err["type"] == "extra_forbidden":
            problems.append((path, _unknown_key_message(loc)))
        elif err["type"] == "missing":
            problems.append((path, "required key is missing"))
        else:
            problems.append((path, f"{err['msg']} (got {err['input']!r})"))
    return problems


def _key_path(loc: tuple[str | int, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _unknown_key_message(loc: tuple[str | int, ...]) -> str:
    allowed = _allowed_keys(loc[:-1])
    msg = "unknown key"
    if allowed:
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        msg += f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(allowed)})"
    return msg


def _allowed_keys(parent: tuple[str | int, ...]) -> list[str]:
    """The field names of the section at `parent`, found by walking RunConfig's annotations."""
    model: Any = RunConfig
    for part in parent:
        if isinstance(part, int):
            continue  # an index into a list: the element model was already resolved below
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        if get_origin(annotation) in (Union, types.UnionType):  # an optional section: `judge: JudgeSection | None`
            annotation = next(
                (arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)), None
            )
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
