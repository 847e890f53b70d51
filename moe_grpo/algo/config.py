"""The RL algorithm's settings (config group `algo`), with the names users of other trainers know.

`algo.loss` picks a member of the GRPO family; each comes with its own preset
for the settings its paper fixes (aggregation, std normalisation, clip range,
dynamic sampling, overlong shaping). Those fields default to `None`, which
means "the loss's preset" (`LOSS_PRESETS`); a value given on the command line
overrides the preset. After construction every field holds a concrete value,
so code reads `run.algo.normalize_std` as a plain bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_grpo.validate import at_least, between, non_negative

LOSS_NAMES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
"""Names `algo.loss` accepts: the keys of `algo.losses.LOSSES` (kept here so configs load without torch)."""

LOSS_AGG_NAMES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""`algo.loss_agg` (verl's `loss_agg_mode` names). `seq-mean-token-sum-norm` divides each sequence's token sum by
the constant `rollout.max_tokens` (Dr. GRPO's constant length normalisation)."""

CORRECTION_NAMES = ("none", "tis", "mis", "icepop")
"""`algo.correction`: train-inference corrections against the rollout log-probs (algo/corrections.py)."""

KL_ESTIMATORS = ("k1", "k3")
"""`algo.kl_estimator`: estimators of KL(learner || reference) per sampled token."""

LOSS_PRESETS: dict[str, dict[str, Any]] = {
    # GRPO: token-mean, std-normalised advantages, PPO clip with DAPO's clip-higher (0.2 below, 0.28 above).
    # verl's and TRL's GRPO default to a symmetric 0.2 (algo.clip_ratio_high=0.2 gives theirs). The wider upper
    # bound lets unlikely tokens with positive advantage grow, which keeps the group's samples apart: on the built-in
    # task the symmetric clip collapsed every group onto one wrong answer for 4- and 5-letter prompts and the
    # default run ended at 0.83-0.86 held-out; clip-higher ended at 0.89-0.92 (docs/results/default-run.md).
    "grpo": dict(loss_agg="token-mean", normalize_std=True, clip_ratio_low=0.2, clip_ratio_high=0.28,
                 dynamic_sampling=False, overlong_buffer=0),
    # Dr. GRPO (Liu et al. 2025): no std normalisation, sum over tokens divided by a constant length.
    "dr_grpo": dict(loss_agg="seq-mean-token-sum-norm", normalize_std=False, clip_ratio_low=0.2,
                    clip_ratio_high=0.2, dynamic_sampling=False, overlong_buffer=0),
    # DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, dynamic sampling, overlong shaping
    # (its buffer is 4096 of 20480 tokens: a fifth of the budget; -1 = a fifth of rollout.max_tokens).
    "dapo": dict(loss_agg="token-mean", normalize_std=True, clip_ratio_low=0.2, clip_ratio_high=0.28,
                 dynamic_sampling=True, overlong_buffer=-1),
    # GSPO (Zheng et al. 2025): sequence-level, length-normalised ratio; its paper clips it to [1-3e-4, 1+4e-4],
    # with the ratio taken against the learner's own old log-probs. Here it is taken against the rollout log-probs,
    # and a bf16 engine's gap alone exceeds that band: on the built-in task the preset collapsed
    # (docs/results/losses.md); widen the clip (e.g. 0.2 / 0.2) with a bf16 engine.
    "gspo": dict(loss_agg="seq-mean-token-mean", normalize_std=True, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                 dynamic_sampling=False, overlong_buffer=0),
    # CISPO (MiniMax-M1, 2025): the importance weight is clipped above only (no lower bound) and detached.
    "cispo": dict(loss_agg="token-mean", normalize_std=True, clip_ratio_low=0.2, clip_ratio_high=0.2,
                  dynamic_sampling=False, overlong_buffer=0),
}
"""Each loss's values for the fields left `None`."""

CORRECTION_PRESETS: dict[str, dict[str, float]] = {
    "none": dict(correction_low=0.0, correction_high=0.0),
    "tis": dict(correction_low=0.0, correction_high=2.0),      # slime tis_clip 2.0, verl threshold 2.0
    "mis": dict(correction_low=0.0, correction_high=2.0),
    "icepop": dict(correction_low=0.5, correction_high=5.0),   # OpenRLHF's band
}
"""Each correction's thresholds for the fields left `None`."""


@dataclass(frozen=True)
class AlgoConfig:
    """GRPO family: loss, aggregation, clipping, corrections, KL, dynamic sampling, staleness."""

    loss: str = "grpo"
    """Policy loss: grpo, dr_grpo, dapo, gspo or cispo (moe_grpo/algo/losses.py: LOSSES)."""
    loss_agg: str | None = None
    """How token losses become the batch loss: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (verl loss_agg_mode); null = the loss's preset."""
    group_size: int = 8
    """Completions sampled per prompt (TRL num_generations, NeMo-RL num_generations_per_prompt, slime n_samples_per_prompt)."""
    prompts_per_step: int = 32
    """Prompts whose groups make one optimizer step's batch."""
    normalize_std: bool | None = None
    """Divide group-relative advantages by the group's reward std (TRL scale_rewards); null = the loss's preset
    (false for dr_grpo, true otherwise)."""
    clip_ratio_low: float | None = None
    """Lower clip: ratio >= 1 - clip_ratio_low (verl clip_ratio_low, TRL epsilon); null = the loss's preset."""
    clip_ratio_high: float | None = None
    """Upper clip: ratio <= 1 + clip_ratio_high (verl clip_ratio_high, TRL epsilon_high; CISPO's cap on its
    importance weight); null = the loss's preset (0.28 for grpo and dapo, 4e-4 for gspo, 0.2 for dr_grpo and cispo)."""
    correction: str = "tis"
    """Train-inference correction against the rollout log-probs: none, tis (truncate the ratio's weight at
    correction_high), mis (mask tokens or sequences above correction_high), icepop (mask tokens whose ratio
    leaves [correction_low, correction_high])."""
    correction_level: str = "token"
    """'token' or 'sequence' (the product of the sequence's token ratios); tis and mis only."""
    correction_low: float | None = None
    """Lower ratio bound of icepop; null = its preset (0.5)."""
    correction_high: float | None = None
    """Upper ratio bound of tis/mis/icepop (slime tis_clip, verl rollout_is_threshold); null = the preset
    (2.0 for tis and mis, 5.0 for icepop)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to a frozen reference policy (the weights after the warm start, or the initial ones
    without a warm start); 0 = off.
    On: the learner keeps a copy of its weights and runs one more forward per step."""
    kl_estimator: str = "k3"
    """KL penalty estimator per token: k1 = log pi - log pi_ref, k3 = r - 1 - log r with r = pi_ref / pi."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and keep sampling until the batch is full;
    null = the loss's preset (on for dapo)."""
    overlong_buffer: int | None = None
    """DAPO's overlong reward shaping: completions longer than rollout.max_tokens - overlong_buffer lose up to
    overlong_penalty linearly, those cut at max_tokens the whole of it; 0 = off, -1 = a fifth of rollout.max_tokens;
    null = the loss's preset (-1 for dapo, 0 otherwise)."""
    overlong_penalty: float = 1.0
    """Reward taken from a completion cut at rollout.max_tokens by the overlong shaping."""
    max_staleness: int = 1
    """No trained token was sampled more than this many policy versions before the weights it trains
    (TRL max_staleness, PRIME-RL max_off_policy_steps, AReaL max_head_offpolicyness). 0 = on-policy."""
    sync_every: int = 1
    """Training steps (batches) between weight syncs to the engines (a new policy version each time)."""
    mini_batches: int = 1
    """Optimizer steps per batch: each data-parallel rank's share of the batch is split into this many parts, one
    optimizer step each, all against the rollout log-probs (verl: train_batch_size / ppo_mini_batch_size; TRL's
    num_iterations > 1 instead repeats the whole batch). With routing.replay=r2 the routing is recorded once,
    before the first part's step, and replayed in every part (verl's R2)."""

    def __post_init__(self) -> None:
        if self.loss not in LOSS_NAMES:
            raise ValueError(f"algo.loss={self.loss!r}, expected one of {sorted(LOSS_NAMES)}")
        if self.correction not in CORRECTION_NAMES:
            raise ValueError(f"algo.correction={self.correction!r}, expected one of {list(CORRECTION_NAMES)}")
        # Fill the fields left None from the presets (frozen: through object.__setattr__, once).
        for name, value in {**LOSS_PRESETS[self.loss], **CORRECTION_PRESETS[self.correction]}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.loss_agg not in LOSS_AGG_NAMES:
            raise ValueError(f"algo.loss_agg={self.loss_agg!r}, expected one of {list(LOSS_AGG_NAMES)}")
        if self.correction_level not in ("token", "sequence"):
            raise ValueError(f"algo.correction_level={self.correction_level!r}, expected 'token' or 'sequence'")
        if self.correction == "icepop" and self.correction_level != "token":
            raise ValueError("algo.correction=icepop masks tokens; algo.correction_level must be 'token'")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algo.kl_estimator={self.kl_estimator!r}, expected one of {list(KL_ESTIMATORS)}")
        at_least("algo.group_size", self.group_size, 2, "(advantages are relative to the group)")
        at_least("algo.prompts_per_step", self.prompts_per_step, 1)
        at_least("algo.mini_batches", self.mini_batches, 1)
        if self.mini_batches > self.prompts_per_step * self.group_size:
            raise ValueError(f"algo.mini_batches={self.mini_batches} > the batch's {self.prompts_per_step} x "
                             f"{self.group_size} completions; expected at most one part per completion")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            between(f"algo.{name}", getattr(self, name), 0.0, 1.0, low_open=True, high_open=True)
        for name in ("correction_low", "correction_high"):
            non_negative(f"algo.{name}", getattr(self, name))
        if self.correction in ("tis", "mis") and not self.correction_high >= 1:
            raise ValueError(f"algo.correction_high={self.correction_high}, expected >= 1 for {self.correction}")
        if self.correction == "icepop" and not 0 < self.correction_low < 1 < self.correction_high:
            raise ValueError(f"algo.correction_low={self.correction_low}, algo.correction_high={self.correction_high}: "
                             "icepop expects 0 < correction_low < 1 < correction_high")
        non_negative("algo.kl_coef", self.kl_coef)
        at_least("algo.overlong_buffer", self.overlong_buffer, -1, "(0 = off, -1 = a fifth of rollout.max_tokens)")
        non_negative("algo.overlong_penalty", self.overlong_penalty)
        at_least("algo.max_staleness", self.max_staleness, 0)
        at_least("algo.sync_every", self.sync_every, 1)

    def overlong_buffer_tokens(self, max_tokens: int) -> int:
        """The overlong shaping's buffer in tokens for completions of at most `max_tokens` (0 = off)."""
        buffer = max(1, max_tokens // 5) if self.overlong_buffer == -1 else int(self.overlong_buffer)
        if buffer > max_tokens:
            raise ValueError(f"algo.overlong_buffer={buffer} is longer than rollout.max_tokens={max_tokens}")
        return buffer

    def token_loss(self, max_response_tokens: int) -> Any:
        """The configured loss, ready to hand to the learner (`max_response_tokens`: rollout.max_tokens, the
        constant of `seq-mean-token-sum-norm`)."""
        from moe_grpo.algo.corrections import Correction
        from moe_grpo.algo.losses import LOSSES, PolicyLoss

        return PolicyLoss(
            objective=LOSSES[self.loss](clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high),
            correction=Correction(self.correction, level=self.correction_level, low=self.correction_low,
                                  high=self.correction_high),
            loss_agg=self.loss_agg, max_response_tokens=max_response_tokens, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator)
