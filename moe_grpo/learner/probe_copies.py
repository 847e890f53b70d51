"""The mismatch probe's side in the learner: copies of the weights as each version was published, and the
engine-vs-learner gap on the same weights scored with them once an engine serves that version (the learner
trains on meanwhile)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from moe_grpo.learner.batch import LearnerSequence, Microbatch
from moe_grpo.learner.forward_pass import RankModel, microbatches, run_schedule, weights_swapped
from moe_grpo.learner.rollout_gap import k3, router_disagreement

MAX_SNAPSHOTS = 2
"""Published versions whose weights `snapshot_weights` keeps for the probe at once (each a copy of the rank's
parameters): the newest and the one before it, whose probe may still be on its way back from the engines."""


class ProbeCopies:
    """The weights of the last `MAX_SNAPSHOTS` published versions (not run state: a resumed run publishes anew)."""

    def __init__(self) -> None:
        self.by_version: dict[int, list[torch.Tensor]] = {}

    def keep(self, version: int, module: Any, dtype: torch.dtype | None = None) -> None:
        """Copy `module`'s weights as `version`, rounded to `dtype` (what the version travels in) and held in
        their own dtype, as the engines hold them; the oldest copy goes beyond `MAX_SNAPSHOTS`."""
        self.by_version[version] = [p.detach().clone() if dtype is None or dtype == p.dtype
                                    else p.detach().to(dtype).to(p.dtype) for p in module.parameters()]
        while len(self.by_version) > MAX_SNAPSHOTS:
            self.by_version.pop(min(self.by_version))

    def take(self, version: int) -> list[torch.Tensor] | None:
        """`version`'s copy, dropped from the kept ones; None when it is gone (a newer one replaced it)."""
        return self.by_version.pop(version, None)


def _k3_sum(mb: Microbatch, out: torch.Tensor) -> Any:
    return out.sum() * 0.0, {"k3": k3(-out.float(), mb.old_logprobs, mb.loss_mask).sum(), "tokens": mb.loss_mask.sum()}


@torch.no_grad()
def probe_gap(rm: RankModel, weights: list[torch.Tensor], seqs: Sequence[LearnerSequence]) -> dict[str, float]:
    """Collective: score `seqs` (with their rollout log-probs and traces) with `weights`, routing replayed (R3)
    and free: `kl_replay_on`, `kl_replay_off` (k3 estimates of KL(rollout || learner) over the response tokens)
    and `router_disagreement` (the free routers' top-k vs the trace; NaN without MoE decisions)."""
    sums = torch.zeros(5, dtype=torch.float64, device=rm.device)
    try:
        with weights_swapped(rm, weights):
            for i, replay in enumerate((True, False)):
                mbs = microbatches(rm, seqs, replay, routing=True)
                store = run_schedule(rm, mbs, replay=replay, forward_only=True, record_free=rm.replayer is not None,
                                     loss_fn=_k3_sum)
                if rm.is_last_stage and rm.rank["tp"] == 0:
                    sums[i] += sum(float(rec["k3"]) for rec in store)
                    sums[2] += sum(float(rec["tokens"]) for rec in store) if i == 0 else 0.0
                if replay and rm.replayer is not None:
                    sums[3:] += torch.tensor(router_disagreement(rm, mbs)[:2], dtype=torch.float64, device=rm.device)
    finally:
        if rm.replayer is not None:
            rm.replayer.reset_counters()
    torch.distributed.all_reduce(sums)
    k3_on, k3_off, tokens, differ, decisions = sums.tolist()
    return {"kl_replay_on": k3_on / tokens, "kl_replay_off": k3_off / tokens,
            "router_disagreement": differ / decisions if decisions else float("nan")}
