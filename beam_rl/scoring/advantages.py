"""Advantage algorithms: a registry of pure functions over one group's rewards, and the object the sink uses.

Conventions (docs/design.md, "Advantages"): n = group size, r = rewards of one group, std Bessel-corrected
unless said. A group of fewer than two rollouts has no baseline: its advantages are 0 everywhere.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from beam_rl.types import Rollout, Sample

GroupFn = Callable[..., np.ndarray]


@dataclass(frozen=True)
class _Entry:
    fn: GroupFn
    batch_whiten: bool


ALGORITHMS: dict[str, _Entry] = {}


def register_algorithm(name: str, *, batch_whiten: bool = False) -> Callable[[GroupFn], GroupFn]:
    """Register a group function under `name`; `batch_whiten` adds the batch-level whitening step.

    The registered function is wrapped so that the singleton rule holds however it is called.
    """

    def decorate(fn: GroupFn) -> GroupFn:
        if name in ALGORITHMS:
            raise ValueError(f"advantage algorithm {name!r} is already registered")

        @functools.wraps(fn)
        def group_fn(rewards: np.ndarray, **params: Any) -> np.ndarray:
            r = np.asarray(rewards, dtype=np.float64).reshape(-1)
            if r.size < 2:
                return np.zeros_like(r)
            return fn(r, **params)

        ALGORITHMS[name] = _Entry(group_fn, batch_whiten)
        return group_fn

    return decorate


@register_algorithm("grpo")
def grpo(rewards: np.ndarray, eps: float = 1e-6, unbiased_std: bool = True) -> np.ndarray:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps).

    std is Bessel-corrected (ddof=1) unless `unbiased_std=False` (ddof=0). eps is added to the std,
    outside the square root. Other frameworks, all with the Bessel-corrected torch `.std()`:
    verl `compute_grpo_outcome_advantage` eps=1e-6 (slime and SkyRL alike); TRL `GRPOTrainer`
    eps=1e-4. A group whose rewards are all equal gets 0 (0 / eps). Singletons get 0 here, whereas
    verl uses mean=0, std=1 for them (A = r / (1 + eps)) and TRL's std of one value is NaN.
    """
    std = rewards.std(ddof=1 if unbiased_std else 0)
    return (rewards - rewards.mean()) / (std + eps)


@register_algorithm("dr_grpo")
def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: A_i = r_i - mean(r) (no std division; verl's `norm_adv_by_std_in_grpo=False`)."""
    return rewards - rewards.mean()


@register_algorithm("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    """RLOO: A_i = r_i - mean_{j != i} r_j = (r_i - mean(r)) * n / (n - 1)."""
    n = rewards.size
    return rewards - (rewards.sum() - rewards) / (n - 1)


@register_algorithm("reinforce_plus_plus_baseline", batch_whiten=True)
def reinforce_plus_plus_baseline(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE++-baseline, group step: A_i = r_i - mean(r).

    The batch step (`AdvantageAlgorithm.batch_normalize`) then whitens over every trainable token
    of the batch, as verl's `masked_whiten`: A_t = (A_t - mean) / sqrt(var + whiten_eps), mean and
    Bessel-corrected var taken over the loss-masked tokens, whiten_eps = 1e-8. (OpenRLHF uses the
    population variance, clamped below at 1e-8.)
    """
    return rewards - rewards.mean()


@register_algorithm("maxrl")
def maxrl(rewards: np.ndarray) -> np.ndarray:
    """MaxRL: A_i = (r_i - mean(r)) / mean(r), and 0 for the whole group where mean(r) <= 0."""
    mean = rewards.mean()
    if mean <= 0:
        return np.zeros_like(rewards)
    return (rewards - mean) / mean


@dataclass(frozen=True)
class AdvantageAlgorithm:
    """A registered algorithm bound to its parameters: what an environment scores its groups with."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    whiten_eps: float | None = None  # set only for algorithms with a batch-level whitening step

    @property
    def key(self) -> tuple[Any, ...]:
        """Identity of the algorithm and its parameters (a batch's samples are whitened per key)."""
        return self.name, tuple(sorted(self.params.items())), self.whiten_eps

    def __hash__(self) -> int:
        return hash(self.key)

    def group_advantages(self, rewards: Sequence[float] | np.ndarray) -> np.ndarray:
        return ALGORITHMS[self.name].fn(np.asarray(rewards, dtype=np.float64), **self.params)

    def finalize_group(self, rollouts: Sequence[Rollout]) -> None:
        """Compute the group's advantages from `r.reward` and write them to `r.advantage`."""
        rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
        if not np.isfinite(rewards).all():
            bad = rollouts[int(np.flatnonzero(~np.isfinite(rewards))[0])]
            raise ValueError(f"rollout {bad.rollout_id}: reward {bad.reward} is not finite")
        for rollout, advantage in zip(rollouts, self.group_advantages(rewards)):
            rollout.advantage = float(advantage)

    def batch_normalize(self, samples: Iterable[Sample]) -> None:
        """Batch-level step, in place on `sample.advantages`; a no-op unless the algorithm whitens."""
        if self.whiten_eps is None:
            return
        samples = list(samples)
        trained = [s.advantages[s.loss_mask].astype(np.float64) for s in samples]
        values = np.concatenate(trained) if trained else np.zeros(0)
        if values.size == 0:
            return
        mean = values.mean()
        # One trainable token has no spread: its centred value is 0, so the variance does not matter.
        var = values.var(ddof=1) if values.size > 1 else 0.0
        scale = 1.0 / np.sqrt(var + self.whiten_eps)
        for s in samples:
            s.advantages = np.where(s.loss_mask, (s.advantages - mean) * scale, 0.0).astype(np.float32)


def get_algorithm(name: str, **params: Any) -> AdvantageAlgorithm:
    """The algorithm registered as `name`, bound to `params` (checked against its signature)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown advantage algorithm {name!r}; registered: {sorted(ALGORITHMS)}")
    entry = ALGORITHMS[name]
    whiten_eps = None
    if entry.batch_whiten:
        whiten_eps = float(params.pop("whiten_eps", 1e-8))
    accepted = [p for p in inspect.signature(entry.fn).parameters if p != "rewards"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        extra = accepted + (["whiten_eps"] if entry.batch_whiten else [])
        raise ValueError(f"advantage algorithm {name!r} takes no parameter {unknown}; it takes {extra}")
    return AdvantageAlgorithm(name, dict(params), whiten_eps)


def algorithm_problems(name: str, params: dict[str, Any]) -> list[tuple[str, str]]:
    """What is wrong with `name` and `params` as an environment's algorithm, as (key, message) pairs with
    keys relative to the env entry ("algorithm", "algorithm_args.<param>"): an unregistered name, a
    parameter the algorithm does not take, a value of another type than its default's, or one it cannot
    compute with. Empty when the algorithm scores a probe group to finite advantages."""
    if name not in ALGORITHMS:
        return [("algorithm", f"unknown advantage algorithm {name!r}; registered: {sorted(ALGORITHMS)}")]
    entry = ALGORITHMS[name]
    defaults = {p.name: p.default for p in inspect.signature(entry.fn).parameters.values() if p.name != "rewards"}
    if entry.batch_whiten:
        defaults["whiten_eps"] = 1e-8
    problems = []
    for param, value in params.items():
        if param not in defaults:
            problems.append(
                (f"algorithm_args.{param}", f"{name!r} takes no parameter {param!r}; it takes {sorted(defaults)}")
            )
        elif not _same_kind(value, defaults[param]):
            problems.append(
                (
                    f"algorithm_args.{param}",
                    f"expected {_kind(defaults[param])} (the default is {defaults[param]!r}), got {value!r}",
                )
            )
    if problems:
        return problems
    try:
        algorithm = get_algorithm(name, **params)
        for rewards in ([0.0, 1.0, 0.25], [0.5, 0.5, 0.5]):  # a spread group, and one of equal rewards
            with np.errstate(all="ignore"):
                advantages = algorithm.group_advantages(rewards)
            if not np.isfinite(advantages).all():
                raise ValueError(f"rewards {rewards} give advantages {advantages.tolist()}")
    except Exception as err:  # a plug-in's own check, or arithmetic that fails on these values
        return [("algorithm_args", f"{name!r} cannot score a group with {params}: {err}")]
    return []


def _same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) == isinstance(default, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and (isinstance(default, float) or isinstance(value, int))
    return default is inspect.Parameter.empty or default is None or isinstance(value, type(default))


def _kind(default: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number"}.get(type(default), type(default).__name__)
