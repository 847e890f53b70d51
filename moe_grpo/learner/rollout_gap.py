"""The gap between the rollout and a learner forward on the same tokens: the k3 estimate of KL(rollout || learner)
per token, and how often the learner's free-running routers pick another top-k set than the rollout's trace.
The training step reports both (`train/*`, `offpolicy/*`); the mismatch probe reports them on published weights."""

from __future__ import annotations

import torch

from moe_grpo.learner.batch import Microbatch
from moe_grpo.learner.forward_pass import RankModel
from moe_grpo.routing.replay import megatron_token_order


def k3(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(rollout || learner), `r - 1 - log r` with `r = exp(logp - rollout_logp)`, zero
    where `mask` is. float64: for |log r| ~ 1e-7 the float32 terms round to exactly zero."""
    log_r = (logp.detach().double() - rollout_logp.double()) * mask
    return (torch.expm1(log_r) - log_r) * mask


def router_disagreement(rm: RankModel, mbs: list[Microbatch],
                        stale: list[torch.Tensor] | None = None) -> tuple[float, float, float, float]:
    """(differing, all, differing stale, all stale) (token, MoE layer) decisions of this rank in the pass just
    run: the routers' free top-k set vs the trace; `stale` marks, per microbatch, the positions of stale
    sequences."""
    assert rm.replayer is not None
    tp, sp_size = rm.rank["tp"], rm.sp_size
    out = torch.zeros(4, dtype=torch.float64)
    for i, mb in enumerate(mbs):
        valid = torch.zeros(mb.input_ids.shape, dtype=torch.int64)
        for _, row, start, end in mb.spans:
            valid[row, start:end] = 1
        old = stale[i].cpu().to(torch.int64) * valid if stale is not None else torch.zeros_like(valid)
        valid, old = (megatron_token_order(t[:, :, None, None], sp_rank=tp, sp_size=sp_size)[:, 0, 0]
                      for t in (valid, old))
        want = megatron_token_order(mb.routing.cpu(), sp_rank=tp, sp_size=sp_size)
        for slot in rm.replayer.slots:
            if i >= len(slot.free):
                continue
            free = torch.sort(slot.free[i].to(torch.int64), -1).values
            differs = ~(free == torch.sort(want[:, slot.moe_index], -1).values).all(-1)
            out += torch.tensor([float((differs & (valid > 0)).sum()), float(valid.sum()),
                                 float((differs & (old > 0)).sum()), float(old.sum())], dtype=torch.float64)
    return tuple(out.tolist())  # type: ignore[return-value]
