"""A learner rank with faults injected at chosen steps: a NaN in one gradient, a mismatch KL that jumps."""

import math

from moe_grpo.orchestrator.learner_actor import LearnerWorker


class FaultyLearner(LearnerWorker):
    nan_at = {3, 13, 14}
    """Steps whose gradient gets a NaN: step 3 alone (skipped and counted), then 13 and 14 in a row (with
    learner.max_skipped_in_a_row=2 the run stops there: a learner that keeps producing NaN is not trained on)."""
    jump_at = {9, 10}
    """Steps whose reported train/rollout_kl is forced far above its running level (two in a row: a sustained jump)."""

    def train(self, seqs, policy_version, replay):
        step = policy_version + 1
        hook = None
        if step in self.nan_at:
            param = next(p for p in self.learner.module.parameters() if p.requires_grad)
            hook = param.register_hook(lambda grad: grad * math.nan)
        try:
            metrics = super().train(seqs, policy_version, replay)
        finally:
            if hook is not None:
                hook.remove()
        if step in self.jump_at and not metrics.get("skipped"):
            metrics["train/rollout_kl"] = 0.5
        return metrics

