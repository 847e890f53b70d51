"""Routing statistics: per-layer expert load and agreement between two traces of the same tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_grpo.routing.trace import RoutingTrace, RoutingTraceError


def expert_load(traces: Sequence[RoutingTrace]) -> np.ndarray:
    """`[moe_layers, num_experts]`: fraction of the (token, slot) assignments each expert received."""
    if not traces:
        raise ValueError("no traces given")
    experts, layers = traces[0].num_experts, traces[0].num_moe_layers
    counts = np.zeros((layers, experts), dtype=np.int64)
    for t in traces:
        if t.num_moe_layers != layers or t.num_experts != experts:
            raise RoutingTraceError(
                f"trace with {t.num_moe_layers} layers / {t.num_experts} experts among traces with {layers} / {experts}")
        ids = t.expert_ids.astype(np.int64)
        for layer in range(layers):
            counts[layer] += np.bincount(ids[:, layer].ravel(), minlength=experts)
    return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)


def agreement(a: Sequence[RoutingTrace], b: Sequence[RoutingTrace]) -> dict[str, object]:
    """How often two traces of the same sequences chose the same experts.

    `set_agreement`: fraction of (token, MoE layer) whose top-k *sets* are
    equal (1 - `mismatch/router_disagreement`, docs/reference/metrics.md);
    `overlap`: mean fraction of the k experts shared; both also per layer.
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} traces vs {len(b)}; expected the same sequences on both sides")
    same_sets, overlap, total = None, None, 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x.expert_ids.shape != y.expert_ids.shape:
            raise RoutingTraceError(f"sequence {i}: shapes {x.expert_ids.shape} and {y.expert_ids.shape} differ")
        xs, ys = np.sort(x.expert_ids.astype(np.int64), -1), np.sort(y.expert_ids.astype(np.int64), -1)
        eq = (xs == ys).all(-1)  # [positions, layers]
        shared = (xs[..., :, None] == ys[..., None, :]).any(-1).sum(-1) / x.top_k
        same_sets = eq.sum(0) if same_sets is None else same_sets + eq.sum(0)
        overlap = shared.sum(0) if overlap is None else overlap + shared.sum(0)
        total += x.num_positions
    total = max(total, 1)
    per_layer = (same_sets / total).tolist()
    return {
        "set_agreement": float(np.mean(per_layer)),
        "overlap": float(np.mean(overlap / total)),
        "set_agreement_per_layer": per_layer,
        "positions": total,
    }
