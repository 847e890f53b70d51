"""The KL penalty's reference policy: a frozen copy of a rank's weights, swapped in for one no-grad forward per
step (no second model: every layout and the routing replay work unchanged). The copy is part of the run state
(`checkpoint_io` saves and loads it, resharded like the weights)."""

from __future__ import annotations

from typing import Any

import torch

from moe_grpo.learner.batch import Microbatch
from moe_grpo.learner.forward_pass import RankModel, run_schedule, weights_swapped


def copy_weights(module: Any) -> list[torch.Tensor]:
    """A copy of `module`'s parameters as they are now (in their dtype): one more copy of the rank's weights."""
    return [p.detach().clone() for p in module.parameters()]


def _keep_logprobs_on_device(mb: Microbatch, output: torch.Tensor) -> Any:
    return output.sum() * 0.0, {"logprobs": (-output.float()).detach()}


@torch.no_grad()
def reference_logprobs(rm: RankModel, reference: list[torch.Tensor], mbs: list[Microbatch], *, replay: bool,
                       targets: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Log-probs of every position of `mbs` under the `reference` weights, routed as the training forward is
    (`replay`: the rollout traces; `targets`: R2's recorded ids), one tensor per microbatch."""
    with weights_swapped(rm, reference):
        store = run_schedule(rm, mbs, replay=replay, targets=targets, forward_only=True,
                             loss_fn=_keep_logprobs_on_device)
    return [rec["logprobs"] for rec in store]
