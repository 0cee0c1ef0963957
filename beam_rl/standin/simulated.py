"""A simulated vLLM engine (no model) for the embedded server's `mode="simulated"`: a continuous batch
of at most `max_num_seqs` sequences stepped on a clock, with a block prefix cache and long-tailed
output lengths, so dispatch policies can be measured at vLLM-like load on a CPU.

The cost model, one engine step at a time (all times multiplied by `time_scale`):

    step_s = decode_base_s + decode_s_per_seq * running + prefill_s_per_token * uncached_prompt_tokens

- `running` is the number of sequences in the batch during the step (each gains one token): decode
  time per token grows with the batch, as a memory-bound GPU's does.
- `uncached_prompt_tokens` are the prompt tokens of requests admitted this step that miss the prefix
  cache. The cache is keyed on full 16-token blocks of prompt tokens, chained like vLLM's block
  hashes (a block hits only if every block before it hit), LRU-evicted beyond `prefix_cache_blocks`.
  The n choices of one request share one prefill (vLLM V1 forks them after the prompt).
- Output lengths are log-normal (median `length_median`, shape `length_sigma`), clipped to
  [1, max_tokens]; a choice shorter than max_tokens ends with a stop/EOS token ("stop"), one that
  reaches it is "length". Seeded requests give identical tokens, lengths and logprobs.
- Sequences are scheduled first-come-first-served; a request's n choices are n sequences (vLLM V1
  units), each freeing its slot when it finishes; the HTTP answer leaves when the last one does.
- A sequence admitted before step a samples its token j during step a + j, with the weights version
  current when that step started; reloads, aborts and pauses land between two steps.
- With `kv_cache_tokens`, the batch's KV cache (each running sequence's prompt plus the tokens it has
  sampled) is bounded, as vLLM V1's is: a waiting sequence is admitted only if its prefix fits, and when
  decoding fills the cache the most recently admitted sequence is preempted (recompute): it goes back to
  the front of the queue with the tokens it has, and on readmission prefills its prompt and those tokens
  again before it samples more. Without it, the cache is as large as the batch needs.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import itertools
import math
import pathlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from beam_rl.standin.backend import IntervalClock, PauseGate
from beam_rl.standin.faults import FaultConfig, FaultInjector
from beam_rl.standin.generator import ChoiceResult, GenerationParams, Weights, WeightsError
from beam_rl.standin.metrics import KV_BLOCK_SIZE


@dataclass(frozen=True)
class SimulatedParams:
    """The engine's cost model; see the module docstring for how each number is used."""

    decode_base_s: float = 0.02  # fixed cost of one engine step (kernel launches, sampling)
    decode_s_per_seq: float = 1e-4  # added per running sequence: at 256 a step costs 2.3x an empty one
    prefill_s_per_token: float = 2e-5  # per uncached prompt token (50k tokens/s of prefill)
    length_median: float = 64.0  # output tokens; log-normal
    length_sigma: float = 1.0  # log-normal shape: 1.0 gives a p99/p50 of ~10
    prefix_cache_blocks: int = 4096  # 16-token blocks the prefix cache keeps (LRU)
    max_model_len: int = 4096
    time_scale: float = 1.0  # every duration above is multiplied by this
    seed: int = 0  # for unseeded requests
    trace_limit: int = 200_000  # engine steps kept for /simulated/trace
    kv_cache_tokens: int | None = None  # the KV cache's size in tokens (None: unbounded, no preemption)

    def __post_init__(self) -> None:
        for name in ("decode_base_s", "decode_s_per_seq", "prefill_s_per_token", "length_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.length_median < 1 or self.prefix_cache_blocks < 0 or self.time_scale <= 0:
            raise ValueError("length_median must be >= 1, prefix_cache_blocks >= 0 and time_scale > 0")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < KV_BLOCK_SIZE:
            raise ValueError(f"kv_cache_tokens must be at least a block ({KV_BLOCK_SIZE}), got {self.kv_cache_tokens}")

    def step_s(self, running: int, prefill_tokens: int) -> float:
        return self.time_scale * (
            self.decode_base_s + self.decode_s_per_seq * running + self.prefill_s_per_token * prefill_tokens
        )


class BlockPrefixCache:
    """vLLM-style prefix cache over prompt tokens: full blocks, chained hashes, LRU; hit/query counters."""

    def __init__(self, capacity_blocks: int, block_size: int = KV_BLOCK_SIZE) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, prompt: tuple[int, ...], salt: str | None = None) -> int:
        """Count the prompt's tokens as queried, cache its full blocks; returns the uncached token count.

        The salt seeds the chain of block hashes (as vLLM hashes `cache_salt` into the first block),
        so a prompt under a new salt misses."""
        self.queries += len(prompt)
        cached, parent, hitting = 0, hash(salt), True
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            parent = hash((parent, prompt[start : start + self.block_size]))
            if hitting and parent in self._blocks:
                cached += self.block_size
                self._blocks.move_to_end(parent)
                continue
            hitting = False
            if self.capacity_blocks:
                self._blocks[parent] = None
                if len(self._blocks) > self.capacity_blocks:
                    self._blocks.popitem(last=False)
        self.hits += cached
        return len(prompt) - cached

    def reset(self) -> None:
        """Forget every cached block (vLLM's /reset_prefix_cache); the counters keep counting."""
        self._blocks.clear()


@dataclass(eq=False)
class _Request:
    params: GenerationParams
    future: asyncio.Future
    choices: list[ChoiceResult]
    remaining: int
    sequences: list[_Sequence] = field(default_factory=list)
    progressed: asyncio.Event | None = None  # set after every step, for requests that stream
    prefilled: bool = False


@dataclass(eq=False)
class _Sequence:
    """One choice: its length drawn when queued, its tokens when first needed (all at once, seeded),
    revealed one per engine step once admitted."""

    request: _Request
    index: int
    key: int  # the seed of its draws
    length: int
    admitted_step: int = -1  # for a sequence preempted with t tokens, its readmission step - t
    drawn: tuple[list[int], list[float], str] | None = None  # token ids, logprobs, finish reason
    preempted_with: int | None = None  # while it waits preempted: the tokens it had sampled


@dataclass
class _Trace:
    """Engine steps as parallel lists: wall-clock start, duration, sequences running."""

    t: collections.deque = field(default_factory=collections.deque)
    duration: collections.deque = field(default_factory=collections.deque)
    running: collections.deque = field(default_factory=collections.deque)


class SimulatedEngine:
    """The continuous-batching engine, a server backend; lives on the server's event loop (no locks)."""

    def __init__(
        self,
        params: SimulatedParams,
        max_num_seqs: int,
        vocab_size: int,
        special_ids: set[int] | frozenset[int],
        eos_token_ids: frozenset[int],
        gate: PauseGate | None = None,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
        self.params = params
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.max_model_len = params.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = BlockPrefixCache(params.prefix_cache_blocks)
        self.max_running = 0
        self.busy_seconds = 0.0  # engine time spent on steps with sequences running
        self._stalled = IntervalClock()
        self._aborted_work = False  # the current pause aborted running or waiting sequences
        # Resumed with nothing to run after aborting work: since when the engine waits for it to come back.
        self._owed_since: float | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.weights = Weights()
        self.kv_capacity_blocks = max(
            1, (params.kv_cache_tokens // KV_BLOCK_SIZE) if params.kv_cache_tokens else params.prefix_cache_blocks
        )
        self.preemptions = 0
        self._weights_from = [(0, self.weights)]  # (first step, weights) at every load and label
        self._allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
        self._gate = gate or PauseGate()
        self._faults = faults or FaultInjector(FaultConfig())
        self._clock = clock
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[tuple[int, int, _Sequence]] = []  # heap of (finish step, order, sequence)
        self._order = itertools.count()
        self._unseeded = itertools.count()
        self._streaming: set[_Request] = set()
        self._in_step = False
        self._at_step_end: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._work: asyncio.Event | None = None  # for the engine loop: work arrived or the gate changed
        self._changed: asyncio.Event | None = None  # for waiters: sequences finished or left
        self._task: asyncio.Task | None = None
        self._gate.on_change(self._gate_changed)
        self.trace = _Trace()

    # -- what the server reads -----------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def stalled_seconds(self) -> float:
        """Engine time pauses took from generation: sequences frozen, queued behind the gate, or aborted by the
        pause, until the first request after the resume (what the pause aborted comes back as new requests).
        Other requests a client holds back during a pause are not seen here."""
        return self._stalled.seconds

    def kv_cache_usage(self) -> float:
        return min(1.0, self._kv_tokens() / KV_BLOCK_SIZE / self.kv_capacity_blocks)

    def _kv_tokens(self) -> int:
        return sum(self._kv_of(s) for _, _, s in self._running)

    def _kv_of(self, sequence: _Sequence) -> int:
        return len(sequence.request.params.prompt_ids) + self._revealed(sequence)

    def trace_since(self, since: float) -> dict[str, Any]:
        """Engine steps that started at or after wall-clock time `since`."""
        t = list(self.trace.t)
        first = int(np.searchsorted(np.asarray(t), since)) if t else 0
        return {
            "max_num_seqs": self.max_num_seqs,
            "t": t[first:],
            "duration": list(itertools.islice(self.trace.duration, first, None)),
            "running": list(itertools.islice(self.trace.running, first, None)),
        }

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, params: GenerationParams, progress: bool = False) -> AsyncIterator[list[ChoiceResult]]:
        """Queue the request's n sequences; yields its choices after every step when `progress`,
        and once all have finished."""
        self._ensure_loop()
        if self._faults.config.latency_s:
            await asyncio.sleep(self._faults.config.latency_s)  # before queueing: holds no slot
        key = params.seed if params.seed is not None else (self.params.seed << 32) + next(self._unseeded)
        request = _Request(
            params, asyncio.get_running_loop().create_future(), [ChoiceResult() for _ in range(params.n)], params.n
        )
        request.sequences = [_Sequence(request, i, key, self._draw_length(params, key, i)) for i in range(params.n)]
        self._waiting.extend(request.sequences)
        if self._owed_since is not None:
            self._stalled.add(self._owed_since)
            self._owed_since = None
        self._poke()
        try:
            if progress:
                request.progressed = asyncio.Event()
                self._streaming.add(request)
                sent = 0
                while not request.future.done():
                    await request.progressed.wait()
                    request.progressed.clear()
                    revealed = self._materialize(request)
                    if revealed > sent and not request.future.done():
                        sent = revealed
                        yield request.choices
            await request.future
        finally:
            self._streaming.discard(request)
            if not request.future.done():
                self._drop(request)  # the client gave up: free its slots, as vLLM aborts the request
        yield request.choices

    def _draw(self, sequence: _Sequence) -> tuple[list[int], list[float], str]:
        """The sequence's tokens, logprobs and finish reason, drawn once (lazily: most are needed
        only when the sequence finishes)."""
        if sequence.drawn is None:
            params, length = sequence.request.params, sequence.length
            rng = np.random.default_rng([sequence.key, sequence.index, 2])
            ids = rng.choice(self._allowed, size=length).tolist()
            stop = self._stop_token(params)
            finish = "length"
            if length < params.max_tokens and stop is not None:
                ids[-1], finish = stop, "stop"
            sequence.drawn = ids, (-rng.exponential(1.0, size=length)).tolist(), finish
        return sequence.drawn

    def _draw_length(self, params: GenerationParams, key: int, index: int) -> int:
        p = self.params
        z = np.random.default_rng([key, index, 1]).standard_normal()
        length = math.ceil(p.length_median * math.exp(p.length_sigma * z))
        if self._stop_token(params) is None:
            return params.max_tokens  # nothing to stop on: every choice runs to max_tokens
        return max(1, min(params.max_tokens, length))

    def _stop_token(self, params: GenerationParams) -> int | None:
        if params.stop_token_ids:
            return min(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_ids:
            return min(self.eos_token_ids)
        return None

    def _revealed(self, sequence: _Sequence) -> int:
        if sequence.preempted_with is not None:
            return sequence.preempted_with
        if sequence.admitted_step < 0:
            return 0
        return min(sequence.length, self.steps - sequence.admitted_step)

    def _weights_of(self, first_step: int, count: int) -> list[Weights]:
        """The weights of each of `count` engine steps from `first_step` on."""
        changes = self._weights_from
        if len(changes) == 1:
            return [self.weights] * count  # never loaded nor labelled: the common case, kept cheap
        span = bisect.bisect_right(changes, first_step, key=lambda change: change[0]) - 1
        weights: list[Weights] = []
        step, end = first_step, first_step + count
        while step < end:
            upto = min(end, changes[span + 1][0]) if span + 1 < len(changes) else end
            weights += [changes[span][1]] * (upto - step)
            step, span = upto, span + 1
        return weights

    def _set_choice(self, sequence: _Sequence, count: int, finish_reason: str | None) -> None:
        """Extend the sequence's choice to its first `count` tokens (never fewer than it has)."""
        choice = sequence.request.choices[sequence.index]
        have = len(choice.token_ids)
        if count > have:
            ids, logprobs, _ = self._draw(sequence)
            if have == 0:  # most choices are filled once, when they finish: no copies
                new_ids, new_logprobs = (ids, logprobs) if count == len(ids) else (ids[:count], logprobs[:count])
                choice.token_ids, choice.logprobs = new_ids, new_logprobs
            else:
                new_ids, new_logprobs = ids[have:count], logprobs[have:count]
                choice.token_ids += new_ids
                choice.logprobs += new_logprobs
            choice.sampled_by += self._weights_of(sequence.admitted_step + have, count - have)
            if sequence.request.params.top_logprobs:
                choice.top_logprobs += [{t: lp} for t, lp in zip(new_ids, new_logprobs)]
        choice.finish_reason = finish_reason

    def _materialize(self, request: _Request) -> int:
        """Fill a streaming request's choices with the tokens its sequences have sampled so far."""
        for sequence in request.sequences:
            if request.choices[sequence.index].finish_reason is None:
                self._set_choice(sequence, self._revealed(sequence), None)
        return sum(len(c.token_ids) for c in request.choices)

    def _finish(self, sequence: _Sequence, count: int, finish_reason: str) -> None:
        self._set_choice(sequence, count, finish_reason)
        request = sequence.request
        request.remaining -= 1
        if request.remaining == 0 and not request.future.done():
            request.future.set_result(None)
        if request.progressed is not None:
            request.progressed.set()

    def _drop(self, request: _Request) -> None:
        self._waiting = collections.deque(s for s in self._waiting if s.request is not request)
        kept = [entry for entry in self._running if entry[2].request is not request]
        if len(kept) != len(self._running):
            heapq.heapify(kept)
            self._running = kept
        self._signal_changed()

    async def abort_all(self) -> None:
        def abort() -> None:
            aborted = [s for _, _, s in self._running] + list(self._waiting)
            for sequence in aborted:
                self._finish(sequence, self._revealed(sequence), "abort")
            self._running, self._waiting = [], collections.deque()
            # Aborted by a pause ("continue" updates), they come back as new requests only once it is over.
            self._aborted_work = bool(aborted) and not self._gate.admits
            self._signal_changed()
            self._poke()

        await self._at_step_boundary(abort)

    async def running_drained(self) -> None:
        await self._until(lambda: not self._running)

    async def quiesce(self) -> None:
        await self._at_step_boundary(lambda: None)

    async def load_weights(self, weights_path: str) -> None:
        # No model to check shapes against; still refuse a path with no weights.
        if not any(pathlib.Path(weights_path).glob("*.safetensors")):
            raise WeightsError(f"no *.safetensors files in {weights_path}")

        await self._at_step_boundary(lambda: self._change_weights(self.weights.loaded()))

    async def label_weights(self, label: str) -> None:
        await self._at_step_boundary(lambda: self._change_weights(self.weights.labelled(label)))

    def _change_weights(self, weights: Weights) -> None:
        self.weights = weights
        if self._weights_from[-1][0] == self.steps:
            self._weights_from.pop()  # changed again before a step sampled with it
        self._weights_from.append((self.steps, weights))

    async def _at_step_boundary(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` between two engine steps (now, if none is in flight)."""
        if not self._in_step:
            return fn()
        future = asyncio.get_running_loop().create_future()
        self._at_step_end.append((fn, future))
        return await future

    async def _until(self, condition: Callable[[], bool]) -> None:
        self._ensure_loop()
        assert self._changed is not None
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    # -- the engine loop -----------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._work, self._changed = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="simulated-engine")

    def _gate_changed(self) -> None:
        if self._gate.admits:
            if self._aborted_work and not self._running and not self._waiting:
                self._owed_since = time.monotonic()
            self._aborted_work = False  # resumed: what the pause aborted may be sent again
        else:
            self._owed_since = None  # paused again before it came back: counted as held by this pause
        self._poke()

    def _poke(self) -> None:
        if self._work is not None:
            self._work.set()

    def _signal_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _admit(self) -> int:
        """Move waiting sequences into the batch while slots (and KV-cache room) are free; returns the
        prompt tokens to prefill: uncached ones, and a preempted sequence's prompt and tokens again."""
        prefill = 0
        bounded = self.params.kv_cache_tokens is not None
        kv = self._kv_tokens() if bounded else 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            sequence = self._waiting[0]
            request = sequence.request
            resumed = sequence.preempted_with or 0
            need = len(request.params.prompt_ids) + resumed + 1
            if bounded and self._running and kv + need > self.kv_capacity_blocks * KV_BLOCK_SIZE:
                break  # first come, first served: nothing behind it jumps the queue
            self._waiting.popleft()
            kv += need
            if sequence.preempted_with is not None:
                prefill += len(request.params.prompt_ids) + resumed  # recomputed
            elif not request.prefilled:
                request.prefilled = True
                prefill += self.prefix_cache.lookup(request.params.prompt_ids, request.params.cache_salt)
                self.prompt_tokens += len(request.params.prompt_ids)
            sequence.admitted_step = self.steps - resumed
            sequence.preempted_with = None
            heapq.heappush(self._running, (sequence.admitted_step + sequence.length, next(self._order), sequence))
        self.max_running = max(self.max_running, len(self._running))
        return prefill

    def _preempt_to_fit(self) -> None:
        """Before a step: while the batch's next tokens would not fit the KV cache, the most recently
        admitted sequence leaves it for the front of the queue, keeping the tokens it sampled."""
        capacity = self.kv_capacity_blocks * KV_BLOCK_SIZE
        kv = self._kv_tokens() + len(self._running)  # each running sequence's next token
        while len(self._running) > 1 and kv > capacity:
            newest = max(self._running, key=lambda entry: entry[2].admitted_step)
            self._running.remove(newest)
            heapq.heapify(self._running)
            sequence = newest[2]
            sampled = self._revealed(sequence)
            self._set_choice(sequence, sampled, None)  # its tokens keep the weights that sampled them
            sequence.preempted_with = sampled
            self._waiting.appendleft(sequence)
            self.preemptions += 1
            kv -= len(sequence.request.params.prompt_ids) + sampled + 1

    def _can_step(self) -> bool:
        if not self._gate.steps:
            return False  # pause "keep": the batch is frozen
        return bool(self._running) or (bool(self._waiting) and self._gate.admits)

    def _held_by_pause(self) -> bool:
        """Is there work only the pause keeps from stepping (running, waiting, or aborted by it)?"""
        return bool(self._running) or ((bool(self._waiting) or self._aborted_work) and not self._gate.admits)

    async def _run(self) -> None:
        assert self._work is not None
        p = self.params
        next_at = self._clock()
        while True:
            if not self._can_step():
                if self._held_by_pause():
                    self._stalled.start()
                self._work.clear()
                await self._work.wait()  # every arrival, abort and gate change pokes it
                self._stalled.stop()
                next_at = self._clock()
                continue
            if self.params.kv_cache_tokens is not None:
                self._preempt_to_fit()
            prefill = self._admit() if self._gate.admits else 0
            running = len(self._running)
            duration = p.step_s(running, prefill) + self._faults.config.step_delay_s
            self._record(duration, running)
            # Sleep to a deadline, so event-loop overhead does not slow the simulated GPU down;
            # one that fell a whole step behind restarts its clock rather than bursting to catch up.
            next_at += duration
            delay = next_at - self._clock()
            self._in_step = True
            try:
                await asyncio.sleep(max(0.0, delay))
            finally:
                self._in_step = False
            if delay < -duration:
                next_at = self._clock()
            self.steps += 1
            self.generation_tokens += len(self._running)
            finished = False
            while self._running and self._running[0][0] <= self.steps:
                sequence = heapq.heappop(self._running)[2]
                self._finish(sequence, sequence.length, self._draw(sequence)[2])
                finished = True
            if finished:
                self._signal_changed()
            for request in self._streaming:
                assert request.progressed is not None
                request.progressed.set()
            calls, self._at_step_end = self._at_step_end, []
            for fn, future in calls:
                if not future.done():
                    future.set_result(fn())

    def _record(self, duration: float, running: int) -> None:
        if running:
            self.busy_seconds += duration  # the same figure the model-backed server reports
        trace = self.trace
        trace.t.append(time.time())
        trace.duration.append(duration)
        trace.running.append(running)
        if len(trace.t) > self.params.trace_limit:
            trace.t.popleft()
            trace.duration.popleft()
            trace.running.popleft()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for sequence in [s for _, _, s in self._running] + list(self._waiting):
            if not sequence.request.future.done():
                sequence.request.future.cancel()
        for _, future in self._at_step_end:
            future.cancel()


def simulated_params_from_args(args: Any) -> SimulatedParams:
    """SimulatedParams from the server's `--sim-*` command-line flags."""
    return SimulatedParams(
        decode_base_s=args.sim_decode_base_s,
        decode_s_per_seq=args.sim_decode_s_per_seq,
        prefill_s_per_token=args.sim_prefill_s_per_token,
        length_median=args.sim_length_median,
        length_sigma=args.sim_length_sigma,
        prefix_cache_blocks=args.sim_prefix_cache_blocks,
        time_scale=args.sim_time_scale,
        seed=args.sim_seed,
        kv_cache_tokens=args.sim_kv_cache_tokens,
    )


def add_simulated_args(parser: Any) -> None:
    """The `--sim-*` flags of `python -m beam_rl.standin.server --mode simulated`."""
    d = SimulatedParams()
    group = parser.add_argument_group("simulated mode (see beam_rl/standin/simulated.py)")
    group.add_argument("--sim-decode-base-s", type=float, default=d.decode_base_s)
    group.add_argument("--sim-decode-s-per-seq", type=float, default=d.decode_s_per_seq)
    group.add_argument("--sim-prefill-s-per-token", type=float, default=d.prefill_s_per_token)
    group.add_argument("--sim-length-median", type=float, default=d.length_median)
    group.add_argument("--sim-length-sigma", type=float, default=d.length_sigma)
    group.add_argument("--sim-prefix-cache-blocks", type=int, default=d.prefix_cache_blocks)
    group.add_argument("--sim-time-scale", type=float, default=d.time_scale)
    group.add_argument("--sim-seed", type=int, default=d.seed)
    group.add_argument(
        "--sim-kv-cache-tokens",
        type=int,
        default=d.kv_cache_tokens,
        help="bound the KV cache to this many tokens: sequences are preempted when it is full",
    )
