"""The reference trainer's maths: sampled-token logprobs of a packed micro-batch row and the clipped policy loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from beam_rl.standin.generator import GREEDY_EPS


def sampled_token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """log pi(token_t | its sample's tokens before t) for every token of one packed row [T]; 0 where a sample starts.

    The row is run as one sequence, not split and padded: with no attention mask, no KV cache and
    position ids that restart at 0 on every sample, transformers builds a block-diagonal causal mask
    (`masking_utils.find_packed_sequence_indices`), so no token attends across samples and no compute
    goes to padding. `use_cache=False` is essential: with a cache transformers skips that detection and
    attention silently crosses samples. `check_packed_attention` verifies a model honours this.

    Logits at position t-1 are divided by token t's temperature (the one it was sampled at), as the
    inference server did before reporting its logprob; below GREEDY_EPS sampling was greedy and the
    server reports unscaled logprobs, so the scale is 1.
    """
    ids = input_ids.long()
    logits = model(input_ids=ids[None], position_ids=position_ids.long()[None], use_cache=False).logits[0]
    temps = temperatures[1:].float()
    temps = torch.where(temps < GREEDY_EPS, torch.ones_like(temps), temps)
    # Token t is predicted from positions < t: logits[t-1] scores ids[t].
    logp = -F.cross_entropy(logits[:-1].float() / temps[:, None], ids[1:], reduction="none")
    logp = torch.cat([logp.new_zeros(1), logp])
    # A sample's first token has no context inside its sample; the logit before it belongs to the previous sample.
    return logp.masked_fill(position_ids == 0, 0.0)


def check_packed_attention(model: torch.nn.Module, atol: float = 1e-4) -> None:
    """Raise RuntimeError unless the model keeps attention inside each packed sample (see sampled_token_logprobs)."""
    embeddings: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[operator]  # a transformers model
    vocab, device = int(embeddings.shape[0]), embeddings.device
    first = torch.arange(1, 6, device=device) % vocab
    second = torch.arange(6, 10, device=device) % vocab

    def positions(n: int) -> torch.Tensor:
        return torch.arange(n, device=device)

    with torch.no_grad():
        packed = sampled_token_logprobs(
            model,
            torch.cat([first, second]),
            torch.cat([positions(len(first)), positions(len(second))]),
            torch.ones(len(first) + len(second), device=device),
        )
        alone = torch.cat(
            [
                sampled_token_logprobs(model, seq, positions(len(seq)), torch.ones(len(seq), device=device))
                for seq in (first, second)
            ]
        )
    error = float((packed - alone).abs().max())
    if not error <= atol:
        raise RuntimeError(
            f"{type(model).__name__} lets packed samples attend to each other (logprob error {error:.3g} > {atol}): "
            "the reference trainer needs a transformers version that masks packed sequences by position_ids "
            f"(found attention implementation {getattr(model.config, '_attn_implementation', '?')!r})"
        )


@dataclass
class PolicyLossStats:
    """Sums over trainable tokens, so micro-batches add up; `summary()` turns them into per-token means."""

    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_min: float = float("inf")
    ratio_max: float = float("-inf")
    clipped: int = 0  # tokens whose gradient the clip zeroed
    mismatch_kl_sum: float = 0.0

    def __add__(self, other: PolicyLossStats) -> PolicyLossStats:
        return PolicyLossStats(
            tokens=self.tokens + other.tokens,
            ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_min=min(self.ratio_min, other.ratio_min),
            ratio_max=max(self.ratio_max, other.ratio_max),
            clipped=self.clipped + other.clipped,
            mismatch_kl_sum=self.mismatch_kl_sum + other.mismatch_kl_sum,
        )

    def summary(self) -> dict[str, float]:
        if not self.tokens:
            return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "clip_fraction": 0.0, "mismatch_kl": 0.0}
        return {
            "ratio_mean": self.ratio_sum / self.tokens,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
            "clip_fraction": self.clipped / self.tokens,
            "mismatch_kl": self.mismatch_kl_sum / self.tokens,
        }


def clipped_policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    num_tokens: int,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The PPO-clip surrogate against the inference policy, normalised by the step's trainable tokens.

        ratio_t = exp(logp_new_t - logp_old_t)         logp_old = the inference server's logprob
        loss    = -(1 / N) * sum_{t in mask} min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)

    N = `num_tokens`, the trainable tokens of the whole step (every micro-batch, every rank), not of
    this micro-batch: summing the micro-batch losses then gives the step's token mean ("token-mean"
    aggregation, as in DAPO), and each token weighs the same whatever micro-batch it was packed into.
    Stats: `clipped` counts tokens where the clipped term is the smaller one (gradient zero), and
    mismatch_kl is the k3 estimate of KL(inference || trainer), mean of ratio - 1 - log ratio.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    mask = mask.bool()
    # Select before exp: context positions carry no inference logprob and must not reach the ratio.
    log_ratio = logp_new[mask] - logp_old[mask].float()
    adv = advantages[mask].float()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    loss = -torch.minimum(unclipped, clipped).sum() / num_tokens
    with torch.no_grad():
        stats = PolicyLossStats(
            tokens=int(ratio.numel()),
            ratio_sum=float(ratio.sum()),
            ratio_min=float(ratio.min()) if ratio.numel() else float("inf"),
            ratio_max=float(ratio.max()) if ratio.numel() else float("-inf"),
            clipped=int((clipped < unclipped).sum()),
            mismatch_kl_sum=float((ratio - 1.0 - log_ratio).sum()),
        )
    return loss, stats
