"""The learner's DDP/optimizer helper and its options, on CPU (the CUDA paths are in test_gpu.py)."""

import pytest
import torch

from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.models.options import MegatronOptions


def test_options_refuse_non_boolean_switches():
    with pytest.raises(ValueError, match="distributed_optimizer='yes'"):
        MegatronOptions(distributed_optimizer="yes")
    with pytest.raises(ValueError, match="grad_reduce_in_fp32=1"):
        MegatronOptions(grad_reduce_in_fp32=1)


def test_pipeline_dtype_follows_the_model_dtype():
    layout = ParallelLayout(pipeline_parallel=2)
    assert layout.megatron_kwargs(4, 8, torch.bfloat16)["pipeline_dtype"] == torch.bfloat16
    assert layout.megatron_kwargs(4, 8)["pipeline_dtype"] == torch.float32
    assert ParallelLayout().megatron_kwargs(4, 8, torch.bfloat16)["pipeline_dtype"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusals")
@pytest.mark.parametrize("options, match", [
    (MegatronOptions(distributed_optimizer=True), "distributed_optimizer=True needs CUDA"),
    (MegatronOptions(params_dtype="bfloat16"), "params_dtype='bfloat16' needs CUDA"),
])
def test_cpu_refuses_what_megatron_only_runs_on_cuda(options, match):
    from layout_scenarios import tiny_spec
    from moe_grpo.learner.megatron_learner import MegatronLearner

    with pytest.raises(ValueError, match=match):
        MegatronLearner(tiny_spec(), options=options)


def test_copy_all_copies_every_pair_on_cpu():
    from moe_grpo.sync.weight_sync import copy_all

    srcs = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(4, 6)[:, ::2]]
    dsts = [torch.empty(3, 4), torch.empty(5), torch.empty(4, 3)]
    copy_all(dsts, srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))
