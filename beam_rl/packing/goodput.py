"""Goodput: every generated token by what became of it, so that trained / generated tokens says how much of
the inference work a run kept (docs/weight-updates.md).

A window's `tokens_by_fate` (schemas/commit_record.py WindowStats) counts each token once, in the step that
decided its fate: a clean rollout's tokens when its group is cut into a batch, every other rollout's when
its window is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from beam_rl.types import Rollout, RolloutRecord, RolloutStatus

TRAINED = "trained"
STALE = "stale"  # past the off-policy bound: filtered at packing, or regenerated / cancelled in dispatch
SERVER_FAILURE = "server_failure"  # lost with a server that failed (tokens it streamed and no one continued)
CANCELLED = "cancelled"  # cancelled at shutdown (the run reached max_steps, or was stopped)
ERRORED = "errored"  # its rollout failed for a reason of its own (the environment, a malformed answer)
REWARD_ERROR = "reward_error"  # generated, but its reward could not be known
FILTERED = "filtered/"  # + the filter's name: flagged junk (zero advantage, gibberish, repetition, ...)


def discarded_fates(rollouts: Iterable[Rollout | RolloutRecord]) -> Counter[str]:
    """Tokens generated for the rollouts and thrown away before their final turns, by fate."""
    fates: Counter[str] = Counter()
    for r in rollouts:
        for fate, tokens in r.discarded_tokens.items():
            if tokens:
                fates[fate] += tokens
    return fates


def unclean_fates(
    rollouts: Iterable[Rollout | RolloutRecord], post_filters: frozenset[str] = frozenset()
) -> Counter[str]:
    """The tokens in the turns of rollouts that will not be trained on whatever comes next: not ok, or
    flagged by a filter before batching. Clean rollouts are counted when their batch is cut (`cut_fates`),
    so those a post-batch filter (named in `post_filters`) flagged then are left out here."""
    fates: Counter[str] = Counter()
    for r in rollouts:
        tokens = r.completion_tokens
        if not tokens or (r.ok and (r.filtered is None or r.filtered in post_filters)):
            continue
        if r.ok and r.filtered is not None:  # always, past the test above
            fates[FILTERED + r.filtered] += tokens
        elif r.status is RolloutStatus.REWARD_ERROR:
            fates[REWARD_ERROR] += tokens
        elif r.status is RolloutStatus.CANCELLED:
            fates[CANCELLED] += tokens
        else:
            fates[ERRORED] += tokens
    return fates


def cut_fates(rollouts: Iterable[Rollout | RolloutRecord]) -> Counter[str]:
    """The tokens of a batch's clean rollouts once its post-batch filters ran: trained, or not (stale)."""
    fates: Counter[str] = Counter()
    for r in rollouts:
        if r.filtered is None:
            fates[TRAINED] += r.completion_tokens
        else:
            fates[STALE if r.filtered == STALE else FILTERED + r.filtered] += r.completion_tokens
    return fates


def goodput(tokens_by_fate: dict[str, int], exclude_filtered: bool = False) -> float | None:
    """Trained tokens over generated tokens (optionally not counting what filters flagged as junk);
    None when nothing was generated."""
    generated = sum(n for fate, n in tokens_by_fate.items() if not (exclude_filtered and fate.startswith(FILTERED)))
    return tokens_by_fate.get(TRAINED, 0) / generated if generated else None


def describe(tokens_by_fate: dict[str, int]) -> str:
    """One line for people: the step's tokens by fate, trained first, and its goodput."""
    if not tokens_by_fate:
        return "tokens by fate: none counted"
    fates = sorted(tokens_by_fate.items(), key=lambda item: (item[0] != TRAINED, item[0]))
    share = goodput(tokens_by_fate)
    return (
        f"tokens by fate: {', '.join(f'{fate} {n}' for fate, n in fates)}; goodput "
        + ("-" if share is None else f"{share:.3f}")
        + f" of {sum(tokens_by_fate.values())} generated"
    )
