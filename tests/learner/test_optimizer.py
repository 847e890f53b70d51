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


def test_the_learning_rate_schedule_is_the_published_one():
    """Linear warmup from 0 over 2 steps, then cosine to min_lr at the run's last step (10), as Megatron's scheduler
    defines it; a rollback's scale multiplies peak and floor; the learner's param groups get exactly that lr."""
    import math

    from layout_scenarios import tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    peak, floor, warm, total = 1e-3, 1e-4, 2, 10
    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(lr=peak, lr_warmup_steps=warm, lr_decay="cosine",
                                                                 min_lr=floor))
    assert learner.lr == peak, "before the first RL step (the warm start) the learner runs at learner.lr"

    def cosine(step):
        if step <= warm:
            return peak * step / warm
        return floor + 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm))) * (peak - floor)

    got = [learner.schedule_lr(step, total) for step in range(1, total + 1)]
    assert got == pytest.approx([cosine(s) for s in range(1, total + 1)], rel=1e-12)
    assert got[1] == pytest.approx(peak) and got[-1] == pytest.approx(floor)
    assert all(g["lr"] == pytest.approx(got[-1]) for g in learner.optimizer.param_groups)
    assert learner.schedule_lr(6, total, scale=0.5) == pytest.approx(0.5 * cosine(6))

    linear = MegatronLearner(tiny_spec(), config=LearnerConfig(lr=peak, lr_decay="linear"))
    assert [linear.schedule_lr(s, 4) for s in (1, 2, 3, 4)] == pytest.approx([peak * (1 - s / 4) for s in (1, 2, 3, 4)])
    constant = MegatronLearner(tiny_spec(), config=LearnerConfig(lr=peak, lr_decay="constant"))
    assert {constant.schedule_lr(s, 300) for s in (1, 150, 300)} == {peak}


def test_bad_schedules_are_refused_by_name():
    from moe_grpo.learner.megatron_learner import LearnerConfig

    with pytest.raises(ValueError, match="lr_decay='exp'"):
        LearnerConfig(lr_decay="exp")
    with pytest.raises(ValueError, match="min_lr=0.1"):
        LearnerConfig(lr=1e-3, min_lr=0.1)
    with pytest.raises(ValueError, match=r"learner.lr_decay_steps=3: expected an integer >= 4"):
        LearnerConfig(lr_warmup_steps=3, lr_decay_steps=3)  # the decay would end before the warmup does
