"""Functions that run inside spawned learner processes for the run-state tests (importable by name)."""

from __future__ import annotations

import logging

LR = 1e-2
LR_FACTOR = 0.5
"""set_lr(LR * LR_FACTOR) before the save: a restored lr differs from the configured one."""


def kl_loss():
    from moe_grpo.algo.corrections import Correction
    from moe_grpo.algo.losses import PolicyLoss

    return PolicyLoss(correction=Correction("tis", high=2.0), kl_coef=0.1)


def batch(spec, step: int):
    """The global batch of optimizer step `step` (a new one every step, the same in every process)."""
    from layout_scenarios import make_sequences

    return make_sequences(spec, n=4, seed=100 + step)


def _build(tp: int, ep: int, pp: int, seed: int):
    from layout_scenarios import tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout

    spec = tiny_spec()
    return spec, MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=LR, seed=seed))


def _step(learner, spec, step: int, loss_fn=None) -> tuple[dict, dict]:
    """One optimizer step on this DP rank's share of `batch(step)`; returns its metrics and the log-probs of the
    whole batch afterwards (gathered from every rank)."""
    from layout_scenarios import shard
    from moe_grpo.learner.parallel import gather_by_index

    idx, mine = shard(batch(spec, step), learner.rank["dp"], learner.rank["dp_size"])
    metrics = learner.train_step(mine, replay=True, loss_fn=loss_fn)
    after = gather_by_index(idx, learner.logprobs(mine, replay=True))
    return metrics, after


def _draws() -> list[float]:
    import random

    import numpy as np
    import torch

    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def train_save_continue(tp: int, ep: int, pp: int, save_to: str, seed: int) -> dict:
    """Step 1, set the KL reference, step 2 (KL loss), set_lr(LR * LR_FACTOR), save_run_state, then what a user
    sees next: the RNG draws right after the save, step 3's metrics and the log-probs after step 3's update."""
    spec, learner = _build(tp, ep, pp, seed)
    _step(learner, spec, 1)
    learner.set_reference()
    _step(learner, spec, 2, kl_loss())
    learner.set_lr(LR * LR_FACTOR)
    learner.save_run_state(save_to)
    draws = _draws()
    metrics, after = _step(learner, spec, 3, kl_loss())
    return {"draws": draws, "step3": metrics, "after": after, "lr": learner.lr, "step_count": learner.step_count}


def resume_and_continue(tp: int, ep: int, pp: int, ckpt: str, seed: int) -> dict:
    """A learner with a history of its own (other seed, one step on another batch, its own reference and lr) loads
    `ckpt` and takes step 3. Then, as a control, it loads `ckpt` again, drops Adam's state (what a weights-only
    resume keeps) and takes step 3 again."""
    from moe_grpo.learner.optimizer import reset_optimizer_state

    spec, learner = _build(tp, ep, pp, seed)
    _step(learner, spec, 99)
    learner.set_reference()
    learner.set_lr(0.123)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("moe_grpo.learner.megatron_learner").addHandler(handler)
    try:
        learner.load_run_state(ckpt)
    finally:
        logging.getLogger("moe_grpo.learner.megatron_learner").removeHandler(handler)
    out = {"lr": learner.lr, "step_count": learner.step_count, "has_reference": learner.has_reference,
           "draws": _draws(), "log": messages}
    out["step3"], out["after"] = _step(learner, spec, 3, kl_loss())
    out["step_count_after"] = learner.step_count

    learner.load_run_state(ckpt)
    reset_optimizer_state(learner.optimizer)
    out["control_step3"], out["control_after"] = _step(learner, spec, 3, kl_loss())
    return out



def load_broken_then_intact(tp: int, ep: int, pp: int, broken: str, intact: str, seed: int) -> dict:
    """load_run_state(broken) (expected to raise IncompleteCheckpointError), then load_run_state(intact)."""
    from moe_grpo.learner.megatron_learner import IncompleteCheckpointError

    _, learner = _build(tp, ep, pp, seed)
    error = None
    try:
        learner.load_run_state(broken)
    except IncompleteCheckpointError as e:
        error = str(e)
    learner.load_run_state(intact)
    return {"error": error, "step_count": learner.step_count, "lr": learner.lr}
