import numpy as np
import pytest

from moe_grpo.routing.trace import RoutingTrace, RoutingTraceError, trace_dtype


def valid_ids(positions=5, layers=3, topk=2, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(experts)[:topk] for _ in range(layers)]) for _ in range(positions)])


def test_dtype_is_uint8_up_to_256_experts_and_16_bit_above():
    assert trace_dtype(8) == np.uint8
    assert trace_dtype(256) == np.uint8
    assert trace_dtype(257) == np.int16
    t = RoutingTrace.from_array(valid_ids(experts=300), 300)
    assert t.expert_ids.dtype == np.int16


def test_bytes_per_token_is_layers_times_topk_times_itemsize():
    # docs/reference/trace-format.md's figure: 60 MoE layers, top-8, uint8 -> 480 bytes per token (int32 would be 1920).
    t = RoutingTrace.from_array(np.zeros((1, 60, 8), np.int64) + np.arange(8), 256)
    assert t.bytes_per_token == 480
    assert RoutingTrace.from_array(valid_ids(experts=1000), 1000).bytes_per_token == 3 * 2 * 2


def test_valid_trace_passes():
    RoutingTrace.from_array(valid_ids(), 8).validate(num_positions=5, num_moe_layers=3, top_k=2, num_experts=8)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_positions=6), "positions=5, expected 6"),
        (dict(num_moe_layers=4), "moe_layers=3, expected 4"),
        (dict(top_k=3), "topk=2, expected 3"),
    ],
)
def test_shape_mismatch_names_field_and_expected_value(kwargs, needle):
    args = dict(num_positions=5, num_moe_layers=3, top_k=2, num_experts=8) | kwargs
    with pytest.raises(RoutingTraceError, match=needle):
        RoutingTrace.from_array(valid_ids(), 8).validate(**args)


def test_expert_id_out_of_range_is_refused_with_its_position():
    ids = valid_ids()
    ids[2, 1, 0] = 8
    with pytest.raises(RoutingTraceError, match=r"expert id 8 out of range, expected 0 <= id < num_experts=8"):
        RoutingTrace.from_array(ids, 8)
    # A trace built by hand (bypassing from_array) is caught by validate, with its location.
    raw = RoutingTrace(ids.astype(np.uint8), 8)
    with pytest.raises(RoutingTraceError, match=r"expert id 8 at \(position 2, moe_layer 1\)"):
        raw.validate(num_positions=5, num_moe_layers=3, top_k=2, num_experts=8)


def test_repeated_id_within_a_token_is_refused():
    ids = valid_ids()
    ids[4, 2] = [3, 3]
    with pytest.raises(RoutingTraceError, match=r"repeats expert id 3 within a token at \(position 4, moe_layer 2\)"):
        RoutingTrace.from_array(ids, 8).validate(num_positions=5, num_moe_layers=3, top_k=2, num_experts=8)


def test_wrong_dtype_and_rank_are_refused():
    with pytest.raises(RoutingTraceError, match="expected 3 dims"):
        RoutingTrace.from_array(np.zeros((4, 2), np.int64), 8)
    with pytest.raises(RoutingTraceError, match="dtype float64, expected an integer type"):
        RoutingTrace.from_array(np.zeros((4, 2, 2)), 8)
    t = RoutingTrace(valid_ids().astype(np.int32), 8)
    with pytest.raises(RoutingTraceError, match="dtype int32, expected uint8"):
        t.validate(num_positions=5, num_moe_layers=3, top_k=2, num_experts=8)


def test_pack_unpack_round_trip_and_corruption():
    t = RoutingTrace.from_array(valid_ids(positions=100, experts=300), 300)
    back = RoutingTrace.unpack(t.pack())
    assert back.num_experts == 300 and back.expert_ids.dtype == np.int16
    np.testing.assert_array_equal(back.expert_ids, t.expert_ids)
    # Packing costs the raw ids plus a small header, not a pickle.
    assert len(t.pack()) < t.expert_ids.nbytes + 200
    with pytest.raises(RoutingTraceError, match="corrupt"):
        RoutingTrace.unpack(t.pack()[:40])
