"""Policy-gradient losses on per-token log-probabilities.

The full GRPO family (KL terms, importance-sampling corrections for stale
rollouts) lands with the training loop; this is the clipped surrogate that
the foundation's learner step uses.
"""

from __future__ import annotations

import torch


def clipped_policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over masked tokens of the PPO/GRPO clipped surrogate, and token-level stats.

    All tensors share one shape (e.g. `[batch, seq]`). Returns the *sum* over
    masked tokens, so the caller chooses the normaliser (tokens of the whole
    global batch, as DAPO's token-level loss does).
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape):
        raise ValueError(
            f"shapes differ: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    log_ratio = (logprobs - old_logprobs) * loss_mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped) * loss_mask
    with torch.no_grad():
        was_clipped = ((unclipped != clipped) & (loss_mask > 0)).float().sum()
    return per_token.sum(), {"clipped_tokens": was_clipped, "ratio_sum": (ratio * loss_mask).sum().detach()}
