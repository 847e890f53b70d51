"""Optimisation and batching settings of the learner (torch-free, so configs load fast)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_grpo.validate import at_least, between, non_negative, optional_at_least, positive


LR_DECAY_STYLES = ("constant", "cosine", "linear")
"""`learner.lr_decay`: decay styles of Megatron's OptimizerParamScheduler offered here."""


@dataclass(frozen=True)
class LearnerConfig:
    """Optimisation and batching settings of the learner."""

    lr: float = 1e-3
    """Adam learning rate (the peak of the schedule). Suits the embedded tiny model; real checkpoints want ~1e-6."""
    lr_warmup_steps: int = 0
    """RL steps over which the learning rate rises linearly from 0 to `lr` (the warm start's supervised steps run at
    `lr` and are not counted)."""
    lr_decay: str = "cosine"
    """After the warmup: 'constant' (stay at `lr`), 'cosine' or 'linear' (fall to `min_lr` at the run's last step).
    Megatron's OptimizerParamScheduler computes it."""
    min_lr: float = 0.0
    """Where 'cosine' and 'linear' end."""
    lr_decay_steps: int | None = None
    """The RL step at which 'cosine' and 'linear' reach `min_lr` (counted from step 1, the warmup included); None =
    the run's `steps`. A run checkpoint saves the schedule, and `resume=true` with another `steps` is refused unless
    this is set: extending a run is a choice between keeping the saved schedule (the value it was saved with: the
    added steps run at `min_lr`) and stretching it (a larger value: the learning rate rises again from where it
    stood)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 64
    """Sequences per microbatch (padded mode)."""
    packed: bool = False
    """Pack several sequences per row behind a block-diagonal mask instead of padding."""
    packed_seq_len: int | None = None
    """Positions per packed row; None = the longest sequence in the batch."""
    seed: int = 1234
    """Seed for weight init and any sampling inside the learner."""
    max_skipped_in_a_row: int = 3
    """Steps skipped in a row for a non-finite loss or gradient (each counted in `faults/steps_skipped`) before the
    run stops with an error; a single bad batch is skipped, a learner that keeps producing NaN is not trained on."""

    def __post_init__(self) -> None:
        positive("learner.lr", self.lr)
        if self.lr_decay not in LR_DECAY_STYLES:
            raise ValueError(f"learner.lr_decay={self.lr_decay!r}, expected one of {list(LR_DECAY_STYLES)}")
        between("learner.min_lr", self.min_lr, 0.0, self.lr)  # the schedule ends at or below its peak
        at_least("learner.lr_warmup_steps", self.lr_warmup_steps, 0)
        optional_at_least("learner.lr_decay_steps", self.lr_decay_steps, self.lr_warmup_steps + 1)
        non_negative("learner.weight_decay", self.weight_decay)
        # Adam divides by (1 - beta^t): beta = 1 never forgets and divides by zero at the first step.
        between("learner.adam_beta1", self.adam_beta1, 0.0, 1.0, high_open=True)
        between("learner.adam_beta2", self.adam_beta2, 0.0, 1.0, high_open=True)
        non_negative("learner.clip_grad", self.clip_grad)
        at_least("learner.micro_batch_size", self.micro_batch_size, 1)
        optional_at_least("learner.packed_seq_len", self.packed_seq_len, 1)
        at_least("learner.seed", self.seed, 0)  # numpy's generators refuse negative seeds
        at_least("learner.max_skipped_in_a_row", self.max_skipped_in_a_row, 1)

    def decay_steps(self, run_steps: int) -> int:
        """The step at which the schedule reaches `min_lr` in a run of `run_steps` steps."""
        return self.lr_decay_steps if self.lr_decay_steps is not None else run_steps

    def schedule(self, run_steps: int) -> dict[str, float | int | str]:
        """The learning-rate schedule of a run of `run_steps` steps, as a run checkpoint saves it."""
        return {"lr": self.lr, "lr_warmup_steps": self.lr_warmup_steps, "lr_decay": self.lr_decay,
                "min_lr": self.min_lr, "lr_decay_steps": self.decay_steps(run_steps)}
