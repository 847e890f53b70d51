"""What the learner's routers chose: the ids of a free-running forward as R2's replay targets, and every router's
ids (used and free-running) per microbatch or per sequence, for tests and the agreement metrics."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from moe_grpo.learner.batch import LearnerSequence, Microbatch
from moe_grpo.learner.forward_pass import RankModel, microbatches, run_schedule, score_only
from moe_grpo.routing.replay import batch_order_from_megatron
from moe_grpo.routing.trace import RoutingTrace


@torch.no_grad()
def record_own_routing(rm: RankModel, mbs: list[Microbatch]) -> list[torch.Tensor]:
    """R2: route the batch freely once (no grad) and return, per microbatch, the ids every router of this
    stage chose, as replay targets `[tokens, moe_layers, topk]` in Megatron order (this rank's tokens).

    megatron-core's own `RouterReplayAction.RECORD` keeps only the last call's ids per router, so with
    several microbatches the ids are taken from `RoutingReplayer`'s per-call record instead."""
    assert rm.replayer is not None
    was_training = rm.model.training
    rm.model.eval()
    try:
        run_schedule(rm, mbs, replay=False, forward_only=True, record_used=True, loss_fn=score_only)
    finally:
        rm.model.train(was_training)
    slots = rm.replayer.slots
    if not slots:  # a pipeline stage without MoE layers has nothing to replay
        return [torch.zeros(0, rm.spec.num_moe_layers, rm.spec.top_k, dtype=torch.int64) for _ in mbs]
    out = []
    for i in range(len(mbs)):
        first = slots[0].used[i]
        ids = torch.zeros(first.shape[0], rm.spec.num_moe_layers, first.shape[1], dtype=torch.int64)
        for slot in slots:
            ids[:, slot.moe_index] = slot.used[i].to(torch.int64)
        out.append(ids)
    rm.replayer.reset_counters()
    return out


@torch.no_grad()
def routing_ids(rm: RankModel, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> dict[str, Any]:
    """The expert ids every router of this stage used (and would have used free-running) on `seqs`:
    `{"used": {moe_index: [b, s, k] per microbatch...}, "free": ..., "microbatches": [...]}` in batch order
    for this rank's sequence-parallel slice."""
    rm.model.eval()
    mbs = microbatches(rm, seqs, replay)
    run_schedule(rm, mbs, replay=replay, forward_only=True, loss_fn=score_only, record_free=True, record_used=True)
    assert rm.replayer is not None
    rows = [mb.input_ids.shape[0] for mb in mbs]  # microbatches may differ in rows (learner/batch.py)
    return {
        "used": {s.moe_index: [batch_order_from_megatron(t, r) for t, r in zip(s.used, rows)]
                 for s in rm.replayer.slots},
        "free": {s.moe_index: [batch_order_from_megatron(t, r) for t, r in zip(s.free, rows)]
                 for s in rm.replayer.slots},
        "microbatches": mbs,
    }


def routing_traces(rm: RankModel, seqs: Sequence[LearnerSequence], *,
                   replay: bool = False) -> dict[str, list[RoutingTrace]]:
    """Per sequence, the routing used and the routing free-running: `{"used": [RoutingTrace...], "free": [...]}`
    (`len(tokens) - 1` rows, MoE layers only). Needs every MoE layer and whole sequences on this rank."""
    if rm.layout.tensor_parallel > 1 or rm.layout.pipeline_parallel > 1:
        raise ValueError("routing_traces needs TP=PP=1 (all MoE layers and whole sequences on one rank)")
    rec = routing_ids(rm, seqs, replay=replay)
    out: dict[str, list[RoutingTrace]] = {"used": [], "free": []}
    spans = {idx: (mb_i, row, start, end) for mb_i, mb in enumerate(rec["microbatches"])
             for idx, row, start, end in mb.spans}
    for k in range(len(seqs)):
        mb_i, row, start, end = spans[k]
        for key in ("used", "free"):
            ids = torch.stack([rec[key][m][mb_i][row, start:end] for m in range(rm.spec.num_moe_layers)], dim=1)
            out[key].append(RoutingTrace.from_array(ids, rm.spec.num_experts))
    return out
