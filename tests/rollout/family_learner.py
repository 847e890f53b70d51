"""The learner side of test_families' syncs, run in spawned processes (importable by name): one pair of processes
per family takes every layout in turn, instead of a new pair per layout (issue 30: each pair costs ~5 s of
starting and importing on 2 cores)."""

from __future__ import annotations

import os
import pickle


def sync_then_route_each_layout(layouts: list[tuple], ckpt_dir: str, eval_tokens: list) -> list[dict]:
    """For each (tp, ep, pp, version, transport_root, handoff, train_seed) in order: a learner of that layout, loaded
    from `ckpt_dir` (Megatron's groups rebuilt for it: parallel.init_distributed), takes one step, publishes
    `version` and measures itself against the engine's routing (layout_scenarios.train_sync_then_route, unchanged).
    Rank 0 writes each layout's result to `handoff`/learner.pkl as soon as it has it, so that the test of that
    layout reads it while the next layout's learner starts."""
    from layout_scenarios import train_sync_then_route

    results = []
    for tp, ep, pp, version, root, handoff, seed in layouts:
        result = train_sync_then_route(tp, ep, pp, ckpt_dir, version, root, handoff, seed, eval_tokens)
        if int(os.environ.get("RANK", "0")) == 0:
            tmp = os.path.join(handoff, "learner.tmp.pkl")
            with open(tmp, "wb") as f:
                pickle.dump(result, f)
            os.replace(tmp, os.path.join(handoff, "learner.pkl"))
        results.append(result)
    return results
