"""Train-inference corrections: a detached per-token weight from the learner/rollout ratio.

The engine samples with its own kernels, precision and (in async mode) older
weights, so the learner's probability of a sampled token differs from the
engine's. With r = exp(learner logprob - rollout logprob) per response token:

- `tis`  (truncated importance sampling): weight min(1, high / r): a token the
  learner finds far likelier than the engine did counts as if r were `high`.
  Multiplied into a PPO-clip token loss this is exactly min(r, high) as the
  importance weight (slime `tis_clip`, verl's token-level TIS).
- `mis`  (masked importance sampling): weight 0 where TIS would truncate
  (r > high), 1 elsewhere: such tokens are dropped instead of down-weighted.
- `icepop`: weight 0 for tokens whose r leaves [low, high] (both sides), 1 inside.

At `level="sequence"` (tis and mis) the ratio is the sequence's, R = the product
of its tokens' ratios. Sequence TIS weights every token of the sequence by
min(R, high) in all, as verl's sequence-level rollout importance sampling and
TRL's `vllm_importance_sampling_mode="sequence_truncate"` do: the detached weight
is min(R, high) / r_t, so that times the loss's own ratio r_t it is min(R, high).
Sequence MIS drops the whole sequence when R > high.

The weight is computed from detached log-probs, so it scales gradients and
never receives one. The learner computes r with the weights it is about to
update (one optimizer step per batch), so r is both the train-inference gap and
the staleness of async samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def segment_sum(values: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of `values` per segment id (`segments` < 0 are left out): a `[num_segments]` tensor, differentiable."""
    flat_seg = segments.reshape(-1)
    keep = flat_seg >= 0
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, flat_seg[keep], values.reshape(-1)[keep])


def broadcast_segments(per_segment: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Each position gets its segment's value (0 where `segments` < 0)."""
    return torch.where(segments >= 0, per_segment[segments.clamp(min=0)], torch.zeros((), dtype=per_segment.dtype,
                                                                                       device=per_segment.device))


@dataclass(frozen=True)
class Correction:
    """One correction; `__call__(log_ratio, mask, segments)` -> (weight, truncated, masked) per token."""

    kind: str = "tis"
    level: str = "token"
    low: float = 0.0
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "tis", "mis", "icepop"):
            raise ValueError(f"correction={self.kind!r}, expected none, tis, mis or icepop")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"correction level={self.level!r}, expected 'token' or 'sequence'")
        if self.kind == "icepop" and self.level != "token":
            raise ValueError("icepop masks tokens; its level must be 'token'")

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor,
                 segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`log_ratio`: learner - rollout log-prob per token (detached inside); `segments`: sequence id per token.

        Returns the weight (float, detached) and boolean tensors of the response tokens whose weight was
        truncated (0 < w < 1) and masked (w = 0)."""
        log_ratio = log_ratio.detach() * mask
        on = mask > 0
        none = torch.zeros_like(on)
        if self.kind == "none":
            return torch.ones_like(log_ratio), none, none
        token_log_ratio = log_ratio
        if self.level == "sequence":
            n = int(segments.max()) + 1 if segments.numel() and int(segments.max()) >= 0 else 0
            log_ratio = broadcast_segments(segment_sum(log_ratio, torch.where(on, segments, -1), n), segments)
        if self.kind == "tis":
            above = (log_ratio > math.log(self.high)) & on
            if self.level == "sequence":  # min(R, high) / r_t on every token of the sequence
                capped = torch.clamp(log_ratio, max=math.log(self.high))
                weight = torch.where(on, torch.exp(capped - token_log_ratio), torch.ones_like(log_ratio))
            else:  # min(1, high / r_t): with the loss's r_t, min(r_t, high)
                weight = torch.where(above, self.high * torch.exp(-log_ratio), torch.ones_like(log_ratio))
            return weight, above, none
        if self.kind == "mis":
            out = (log_ratio > math.log(self.high)) & on
        else:  # icepop
            ratio = torch.exp(log_ratio)
            out = ((ratio < self.low) | (ratio > self.high)) & on
        return (~out).to(log_ratio.dtype), none, out
