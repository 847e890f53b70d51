"""An engine of pipeline stages, before and after vLLM starts, without an engine: the options refused, vLLM's
arguments, the workers' start-up answers checked, and each stage's routing joined into one trace in layer order."""

import numpy as np
import pytest

from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.engine_outputs import join_stage_routing, unpack_routing
from moe_grpo.rollout.engine_setup import capture_order, check_options, check_workers


def _options(**kw):
    base = dict(tensor_parallel=1, routing_source="extension", on_update="keep", capture=True, extension=True,
                lora=None, lora_apply="merge")
    check_options(**{**base, **kw})


def test_pipeline_options_refused_with_the_bad_value():
    with pytest.raises(ValueError, match=r"pipeline_parallel=0, expected an integer >= 1"):
        _options(pipeline_parallel=0)
    with pytest.raises(ValueError, match=r"pipeline_parallel=5 stages for a model of 4 decoder layers"):
        _options(pipeline_parallel=5, num_layers=4)
    _options(pipeline_parallel=4, num_layers=4)


def _info(tp, pp, capturing, layers=(1,)):
    return {"tp_rank": tp, "pp_rank": pp, "capturing": capturing, "pid": 100 + 10 * pp + tp, "moe_layers": list(layers)}


def test_workers_of_two_stages_each_capture_their_own_layers_in_stage_order():
    """Answers come in any order; the capture order is by stage, so the traces join in layer order."""
    infos = [_info(0, 1, True, [2, 3]), _info(0, 0, True, [1])]
    assert check_workers(infos, 1, True, "e", pipeline_parallel=2) == [0, 0]
    assert capture_order(infos) == [1, 0]
    tp_pp = [_info(1, 0, False), _info(0, 1, True), _info(0, 0, True), _info(1, 1, False)]
    assert check_workers(tp_pp, 2, True, "e", pipeline_parallel=2) == [1, 0, 0, 1]
    assert capture_order(tp_pp) == [2, 1]


def test_a_stage_holding_only_dense_layers_is_not_asked_for_routing():
    """A PP=3 engine of the default model (3 layers, the first dense): stage 0 holds no MoE layer and records no
    rows. Would have caught: every request failing "routing captured by 2 of 3 pipeline stages", the run never
    reaching step 1 (seen in a user's trial, 2026-11-28)."""
    infos = [_info(0, 2, True, [2]), _info(0, 0, True, []), _info(0, 1, True, [1])]
    assert check_workers(infos, 1, True, "e", pipeline_parallel=3) == [0, 0, 0]
    assert capture_order(infos) == [2, 0], "stages 1 and 2, in stage order; stage 0 has nothing to record"
    stages = [unpack_routing(_packed("r", np.zeros((4, 1, 2), np.int16))) for _ in capture_order(infos)]
    assert join_stage_routing(stages)["rows"].shape == (4, 2, 2)


def test_worker_answers_that_do_not_make_the_stages_are_refused():
    with pytest.raises(EngineError, match=r"1 vLLM workers answered, expected tensor_parallel=1 x "
                                          r"pipeline_parallel=2 = 2"):
        check_workers([_info(0, 0, True)], 1, True, "e", pipeline_parallel=2)
    with pytest.raises(EngineError, match=r"\(pipeline stage, tensor-parallel rank\) \[\(0, 0\), \(0, 0\)\]"):
        check_workers([_info(0, 0, True), _info(0, 0, True)], 1, True, "e", pipeline_parallel=2)
    with pytest.raises(EngineError, match=r"routing captured by .* \[\(0, 0\)\], expected tensor-parallel rank 0 "
                                          r"of each stage alone"):
        check_workers([_info(0, 0, True), _info(0, 1, False)], 1, True, "e", pipeline_parallel=2)


def _packed(rid, rows):
    return {rid: (rows.dtype.str, list(rows.shape), rows.tobytes())}


def test_stage_traces_join_in_layer_order_cut_to_the_rows_all_stages_hold():
    first = np.arange(4 * 1 * 2, dtype=np.int16).reshape(4, 1, 2)  # layer 1 (layer 0 dense)
    second = np.arange(100, 100 + 6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)  # layers 2-3, buffer grown further
    joined = join_stage_routing([unpack_routing(_packed("r", first)), unpack_routing(_packed("r", second))])
    assert joined["rows"].shape == (4, 3, 2)
    assert (joined["rows"][:, :1] == first).all() and (joined["rows"][:, 1:] == second[:4]).all()


def test_a_stage_error_or_missing_stage_fails_the_request():
    rows = unpack_routing(_packed("r", np.zeros((3, 1, 2), np.int16)))
    assert join_stage_routing([rows, {"error": "boom"}]) == {"error": "boom"}
    assert join_stage_routing([rows, {}]) == {"error": "routing captured by 1 of 2 pipeline stages"}
    assert join_stage_routing([{}, {}]) == {}
    assert join_stage_routing([rows]) is rows  # one stage: as before
