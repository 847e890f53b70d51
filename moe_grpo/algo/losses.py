"""The GRPO family of policy losses against the rollout log-probs.

A loss the learner calls is a `PolicyLoss`:

    loss(logprobs, rollout_logprobs, advantages, mask, staleness, *, segments=None, ref_logprobs=None)
        -> (numerator, {stat: sum over response tokens})

All tensors have one shape, `[rows, seq]` (a microbatch). `segments` gives each
position the index of its sequence in the microbatch (-1 on padding); rows
are sequences when it is None (padded microbatches), several sequences share a
row in packed ones, so sequence-level terms (GSPO's ratio, sequence-level
corrections, `seq-mean-*` aggregation) are computed per segment. `staleness`
is, per token, how many policy versions the trained weights are ahead of the
weights that sampled it (available to losses; the built-in ones do not use it:
the ratio to the rollout log-probs already carries it).

**Normalisation across micro-batches and data-parallel ranks.** A loss
returns a *numerator*, summed over its microbatch; `normaliser` says what the
caller divides it by: "tokens" (the response tokens of the whole global
batch, for token-mean) or "sequences" (the sequences of the whole global
batch, for the seq-mean-* modes). The learner all-reduces that count over DP
ranks before the step, so the gradient is the same however the batch is split
into microbatches, ranks or calls:

    token-mean               sum_i sum_t l_it / sum_i T_i
    seq-mean-token-sum       sum_i sum_t l_it / N
    seq-mean-token-mean      sum_i (sum_t l_it / T_i) / N
    seq-mean-token-sum-norm  sum_i (sum_t l_it / L) / N      L = max_response_tokens (Dr. GRPO)

Statistics are token sums; the caller divides them by the global response
tokens, so they read as fractions / means per token.

Per-token objectives (`LOSSES`), with r = exp(logprob - rollout_logprob):

- grpo / dr_grpo / dapo: PPO clip, -min(r A, clip(r, 1-low, 1+high) A). They
  differ in presets (algo/config.py: aggregation, std normalisation, DAPO's
  clip-higher, dynamic sampling and overlong shaping).
- gspo: the sequence's length-normalised ratio s = exp(mean_t log r_t) in
  place of r; per token the value is s and the gradient s * grad log pi_t
  (s_it = sg(s) pi_t / sg(pi_t)), so with seq-mean-token-mean the loss is
  exactly GSPO's -min(s A, clip(s) A) per sequence.
- cispo: -sg(min(r, 1+high)) A log pi: every token keeps a gradient, its
  importance weight is clipped and detached.

The correction (algo/corrections.py) multiplies each token's loss by a
detached weight; the optional KL penalty adds kl_coef * KL(pi || pi_ref) per
token (k1 or k3), aggregated the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moe_grpo.algo.corrections import Correction, broadcast_segments, segment_sum


class TokenLoss(Protocol):
    stat_keys: tuple[str, ...]
    normaliser: str
    kl_coef: float

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, staleness: torch.Tensor, *, segments: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"loss inputs must share one shape, got {shapes}")


def row_segments(mask: torch.Tensor) -> torch.Tensor:
    """One sequence per row (padded microbatches): segment id = row index."""
    rows = torch.arange(mask.shape[0], device=mask.device).view(-1, *([1] * (mask.dim() - 1)))
    return rows.expand_as(mask).clone()


def _num_segments(segments: torch.Tensor) -> int:
    return int(segments.max()) + 1 if segments.numel() else 0


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float,
                      high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, -min(r A, clip(r, 1 - low, 1 + high) A), and where the clip changed r.

    The gradient flows through whichever of the two terms is the minimum: none where the clipped term is."""
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return -torch.minimum(ratio * advantages, clipped * advantages), ratio.detach() != clipped.detach()


@dataclass(frozen=True)
class PPOClip:
    """-min(r A, clip(r, 1 - low, 1 + high) A) per token (grpo, dr_grpo, dapo)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __call__(self, log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return clipped_surrogate(torch.exp(log_ratio), advantages, self.clip_ratio_low, self.clip_ratio_high)


@dataclass(frozen=True)
class GSPO:
    """PPO clip on the sequence's length-normalised ratio (value s, gradient s * grad log pi_t per token)."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4

    def __call__(self, log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = _num_segments(segments)
        seg = torch.where(mask > 0, segments, -1)
        lengths = segment_sum(mask, seg, n).clamp(min=1)
        seq_log = broadcast_segments(segment_sum(log_ratio.detach(), seg, n) / lengths, segments)
        ratio = torch.exp(seq_log + logprobs - logprobs.detach())
        return clipped_surrogate(ratio, advantages, self.clip_ratio_low, self.clip_ratio_high)


@dataclass(frozen=True)
class CISPO:
    """-sg(min(r, 1 + high)) A log pi per token; `clip_ratio_low` is unused (CISPO sets no lower bound)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __call__(self, log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = torch.exp(log_ratio.detach())
        weight = torch.clamp(ratio, max=1.0 + self.clip_ratio_high)
        return -weight * advantages * logprobs, ratio > 1.0 + self.clip_ratio_high


LOSSES: dict[str, type] = {"grpo": PPOClip, "dr_grpo": PPOClip, "dapo": PPOClip, "gspo": GSPO, "cispo": CISPO}
"""`algo.loss` -> per-token objective (built from `algo.clip_ratio_low/high`); presets in algo/config.py."""


@dataclass(frozen=True)
class PolicyLoss:
    """Objective x correction, plus an optional KL penalty, aggregated by `loss_agg` (see the module docstring)."""

    objective: Any = field(default_factory=PPOClip)
    correction: Correction = field(default_factory=Correction)
    loss_agg: str = "token-mean"
    max_response_tokens: int = 0
    """L of seq-mean-token-sum-norm (rollout.max_tokens)."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.loss_agg not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            raise ValueError(f"loss_agg={self.loss_agg!r}, expected token-mean, seq-mean-token-sum, "
                             "seq-mean-token-mean or seq-mean-token-sum-norm")
        if self.loss_agg == "seq-mean-token-sum-norm" and self.max_response_tokens < 1:
            raise ValueError("loss_agg=seq-mean-token-sum-norm needs max_response_tokens >= 1 (its constant length)")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r}, expected 'k1' or 'k3'")

    @property
    def normaliser(self) -> str:
        """What the caller divides the numerator by: the global batch's response 'tokens' or 'sequences'."""
        return "tokens" if self.loss_agg == "token-mean" else "sequences"

    @property
    def stat_keys(self) -> tuple[str, ...]:
        keys = ("clip_fraction", "ratio_mean", "correction/truncated_fraction", "correction/masked_fraction")
        return keys + (("kl/reference",) if self.kl_coef > 0 else ())

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, staleness: torch.Tensor, *, segments: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _check_shapes(logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages, mask=mask,
                      staleness=staleness, segments=segments, ref_logprobs=ref_logprobs)
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs of the same tokens)")
        segments = row_segments(mask) if segments is None else segments
        log_ratio = (logprobs - rollout_logprobs) * mask
        per_token, clipped = self.objective(log_ratio, logprobs, advantages, mask, segments)
        weight, truncated, masked = self.correction(log_ratio, mask, segments)
        per_token = per_token * weight
        kl = None
        if self.kl_coef > 0:
            d = (ref_logprobs - logprobs) * mask  # log(pi_ref / pi)
            kl = -d if self.kl_estimator == "k1" else torch.expm1(d) - d
            per_token = per_token + self.kl_coef * kl
        numerator = self._aggregate(per_token * mask, mask, segments)
        with torch.no_grad():
            on = mask > 0
            stats = {
                "clip_fraction": (clipped & on).float().sum(),
                "ratio_mean": (torch.exp(log_ratio.detach()) * mask).sum(),
                "correction/truncated_fraction": (truncated & on).float().sum(),
                "correction/masked_fraction": (masked & on).float().sum(),
            }
            if kl is not None:
                stats["kl/reference"] = (kl.detach() * mask).sum()
        return numerator, stats

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        if self.loss_agg in ("token-mean", "seq-mean-token-sum"):
            return per_token.sum()
        if self.loss_agg == "seq-mean-token-sum-norm":
            return per_token.sum() / self.max_response_tokens
        seg = torch.where(mask > 0, segments, -1)
        n = _num_segments(segments)
        lengths = segment_sum(mask, seg, n)
        sums = segment_sum(per_token, seg, n)
        return (sums / lengths.clamp(min=1)).sum()
