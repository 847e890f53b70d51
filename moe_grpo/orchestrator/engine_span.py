"""Engines whose pipeline stages span nodes: how one engine's vLLM workers lie over whole nodes, or why they cannot.

An engine of `tensor_parallel` x `pipeline_parallel` workers (one GPU each) fits one node when the node has that many
GPUs; beyond it, its stages go to several nodes through vLLM's Ray executor (rollout/engine_setup.py). A stage's
tensor-parallel workers stay within one node (their all-reduce every layer would otherwise cross the network), and
the engine fills whole nodes: each node holds `stages_per_node` whole stages. vLLM 0.32 gives worker ranks
stage-major (rank = stage x TP + TP rank) to the placement group's GPU bundles sorted by node, the engine core's
node first (`vllm/v1/executor/ray_utils.py` `get_bundles_sorted_by_node`), so whole stages per node keep every
stage on one node. Pure functions of the numbers: the placement plan calls them (orchestrator/placement_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moe_grpo.rollout.ray_executor import RAY_ON_CPU_REFUSAL



@dataclass(frozen=True)
class EngineSpan:
    """How one engine's workers lie over nodes."""

    tensor_parallel: int
    pipeline_parallel: int
    nodes: int
    """Nodes one engine occupies (1: every stage on one node, vLLM's multiprocessing executor)."""
    stages_per_node: int
    """Whole pipeline stages on each of those nodes."""

    @property
    def workers(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    def worker_nodes(self, nodes: Sequence[str]) -> list[str]:
        """The node of each worker, in vLLM's rank order (stage-major), given the engine's `nodes` (stage 0's
        first): one placement bundle per worker."""
        if len(nodes) != self.nodes:
            raise ValueError(f"an engine spanning {self.nodes} node(s) was given {len(nodes)}: {list(nodes)}")
        return [nodes[stage // self.stages_per_node] for stage in range(self.pipeline_parallel)
                for _ in range(self.tensor_parallel)]


def engine_span(tensor_parallel: int, pipeline_parallel: int, gpus_per_node: int) -> tuple[EngineSpan | None, str | None]:
    """(the engine's span, None) on nodes of `gpus_per_node` GPUs, or (None, why not, with the numbers)."""
    tp, pp, gpus = tensor_parallel, pipeline_parallel, gpus_per_node
    workers = tp * pp
    if workers <= gpus:
        return EngineSpan(tp, pp, 1, pp), None
    if tp > gpus:
        return None, (f"an engine's tensor parallelism (cluster.engine_tensor_parallel={tp}) does not fit a node of "
                      f"{gpus} GPUs: a stage's tensor-parallel workers run within one node (only pipeline stages, "
                      "cluster.engine_pipeline_parallel, span nodes)")
    if gpus % tp:
        return None, (f"an engine of cluster.engine_tensor_parallel={tp} x cluster.engine_pipeline_parallel={pp} = "
                      f"{workers} GPUs spans nodes of {gpus} GPUs, but TP={tp} does not divide a node's {gpus} GPUs: "
                      "an engine spanning nodes holds whole stages on whole nodes")
    per_node = gpus // tp
    if pp % per_node:
        return None, (f"an engine of cluster.engine_tensor_parallel={tp} x cluster.engine_pipeline_parallel={pp} = "
                      f"{workers} GPUs spans nodes of {gpus} GPUs ({per_node} stage(s) of TP={tp} each), but PP={pp} "
                      f"is not a multiple of {per_node}: its last node would be part-filled (set "
                      f"cluster.engine_pipeline_parallel to a multiple of {per_node})")
    return EngineSpan(tp, pp, pp // per_node, per_node), None


__all__ = ["RAY_ON_CPU_REFUSAL", "EngineSpan", "engine_span"]
