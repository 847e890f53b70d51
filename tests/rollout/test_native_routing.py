"""Pure logic: vLLM's native routed_experts (all layers) -> the trace contract (MoE layers only)."""

import numpy as np
import pytest

from layout_scenarios import tiny_spec
from moe_grpo.rollout.vllm_engine import EngineError, native_routing_to_trace


def test_dense_layer_columns_are_dropped_and_rows_trimmed():
    spec = tiny_spec()  # 4 layers, first one dense
    rng = np.random.default_rng(0)
    routed = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(4)]) for _ in range(12)]).astype(np.uint8)
    trace = native_routing_to_trace(routed, spec, num_positions=10)
    assert trace.expert_ids.shape == (10, 3, 2)
    np.testing.assert_array_equal(trace.expert_ids, routed[:10, 1:])


def test_wrong_native_shapes_are_named():
    spec = tiny_spec()
    with pytest.raises(EngineError, match="has 2 layers, expected 4"):
        native_routing_to_trace(np.zeros((5, 2, 2), np.uint8), spec, 4)
    with pytest.raises(EngineError, match="has 3 rows, expected 4"):
        native_routing_to_trace(np.tile(np.arange(2, dtype=np.uint8), (3, 3, 1)), spec, 4)
