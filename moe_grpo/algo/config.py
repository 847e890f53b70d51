"""The RL algorithm's settings (config group `algo`), with the names users of other trainers know."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LOSS_NAMES = ("grpo",)
"""Names `algo.loss` accepts: the keys of `algo.losses.LOSSES` (kept here so configs load without torch)."""


@dataclass(frozen=True)
class AlgoConfig:
    """GRPO: group size, batch, clipping, corrections, staleness."""

    loss: str = "grpo"
    """Token-level loss (moe_grpo/algo/losses.py: LOSSES)."""
    group_size: int = 8
    """Completions sampled per prompt (TRL num_generations, NeMo-RL num_generations_per_prompt, slime n_samples_per_prompt)."""
    prompts_per_step: int = 32
    """Prompts whose groups make one optimizer step's batch."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's reward std (Dr. GRPO turns this off)."""
    clip_ratio_low: float = 0.2
    """Lower PPO clip: ratio >= 1 - clip_ratio_low (verl clip_ratio_low, TRL epsilon)."""
    clip_ratio_high: float = 0.2
    """Upper PPO clip: ratio <= 1 + clip_ratio_high (verl clip_ratio_high, TRL epsilon_high)."""
    tis_clip: float = 2.0
    """Truncated importance sampling: cap on the gradient weight of the learner/rollout ratio; 0 = off (slime tis_clip)."""
    max_staleness: int = 1
    """No trained token was sampled more than this many policy versions before the weights it trains
    (TRL max_staleness, PRIME-RL max_off_policy_steps, AReaL max_head_offpolicyness). 0 = on-policy."""
    sync_every: int = 1
    """Optimizer steps between weight syncs to the engines (a new policy version each time)."""

    def __post_init__(self) -> None:
        if self.loss not in LOSS_NAMES:
            raise ValueError(f"algo.loss={self.loss!r}, expected one of {sorted(LOSS_NAMES)}")
        if self.group_size < 2:
            raise ValueError(f"algo.group_size={self.group_size}, expected >= 2 (advantages are relative to the group)")
        if self.prompts_per_step < 1:
            raise ValueError(f"algo.prompts_per_step={self.prompts_per_step}, expected >= 1")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, name)
            if not 0 < v < 1 or not math.isfinite(v):
                raise ValueError(f"algo.{name}={v}, expected 0 < {name} < 1")
        if self.tis_clip != 0 and not self.tis_clip >= 1:
            raise ValueError(f"algo.tis_clip={self.tis_clip}, expected 0 (off) or >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"algo.max_staleness={self.max_staleness}, expected >= 0")
        if self.sync_every < 1:
            raise ValueError(f"algo.sync_every={self.sync_every}, expected >= 1")

    def token_loss(self) -> Any:
        """The configured loss, ready to hand to the learner."""
        from moe_grpo.algo.losses import LOSSES

        return LOSSES[self.loss](clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                                 tis_clip=self.tis_clip)
