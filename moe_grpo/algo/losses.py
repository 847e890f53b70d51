"""Token-level policy-gradient losses against the rollout log-probs.

A loss is a callable `(logprobs, rollout_logprobs, advantages, mask, staleness)
-> (sum over masked tokens, {stat: sum over masked tokens})`, all tensors of one
shape (`[rows, seq]`). It returns sums so the caller picks the normaliser (the
response tokens of the whole global batch: token-mean, as DAPO argues), and
`stat_keys` names the statistics it reports, as fractions of those tokens.
`staleness` is, per token, how many policy versions the trained weights are
ahead of the weights that sampled it.

The rest of the GRPO family (Dr. GRPO, DAPO, GSPO, CISPO, MIS, IcePop) plugs in
here with the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class TokenLoss(Protocol):
    stat_keys: tuple[str, ...]

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, staleness: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"loss inputs must share one shape, got {shapes}")


@dataclass(frozen=True)
class GRPOLoss:
    """Clipped GRPO surrogate on the ratio to the rollout policy, with truncated importance sampling.

    Per response token, with r = exp(logprob - rollout_logprob), the ratio
    between the learner and the weights (and engine) that sampled the token:

        loss = -min(r_tis * A, clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high) * A)

    The clip is PPO's trust region around the sampling policy. `r_tis` is r
    truncated at `tis_clip` (TIS: min(r, tis_clip), in value and gradient): a
    token the learner finds far likelier than the engine did (the
    train-inference gap, or a stale sample in async mode) cannot dominate a
    negative-advantage update, where the clip alone does not bound r.
    `tis_clip=0` turns the truncation off.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    tis_clip: float = 2.0
    stat_keys: tuple[str, ...] = ("clip_fraction", "tis_truncated_fraction", "ratio_mean")

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, staleness: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _check_shapes(logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages, mask=mask,
                      staleness=staleness)
        ratio = torch.exp((logprobs - rollout_logprobs) * mask)
        clipped = torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        weighted = ratio
        truncated = torch.zeros_like(mask, dtype=torch.bool)
        if self.tis_clip > 0:
            truncated = ratio.detach() > self.tis_clip
            weighted = torch.where(truncated, ratio * (self.tis_clip / ratio.detach()), ratio)
        per_token = -torch.minimum(weighted * advantages, clipped * advantages) * mask
        with torch.no_grad():
            on = mask > 0
            stats = {
                "clip_fraction": ((ratio != clipped) & on).float().sum(),
                "tis_truncated_fraction": (truncated & on).float().sum(),
                "ratio_mean": (ratio * mask).sum(),
            }
        return per_token.sum(), stats


LOSSES = {"grpo": GRPOLoss}
"""`algo.loss` -> loss class (constructed from the matching `algo.*` fields)."""
