"""On a CUDA machine: the learner with replay runs on the GPU, with no CPU patch applied."""

import pytest

pytestmark = [pytest.mark.gpu]


def test_learner_replays_routing_on_cuda():
    import torch

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner import megatron_cpu
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2))
    assert next(learner.module.parameters()).is_cuda
    assert not set(megatron_cpu.applied()) & {p.name for p in megatron_cpu.CPU_PATCHES}
    seqs = make_sequences(tiny_spec(), n=4)
    free = learner.logprobs(seqs, replay=False)
    replayed = learner.logprobs(seqs, replay=True)
    assert max(float(abs(a - b).max()) for a, b in zip(free, replayed)) > 1e-4
    metrics = learner.train_step(seqs, replay=True)
    assert metrics["grad_norm"] > 0
    torch.cuda.synchronize()


def test_weight_sync_publishes_cuda_weights(tmp_path):
    """The sync copies CUDA shards into the host's shared-memory buckets (device -> host in the copy)."""
    import torch

    from layout_scenarios import tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2))
    WeightSync(learner, SharedMemoryTransport(str(tmp_path)), max_bucket_bytes=1 << 16).sync(1)
    got = SharedMemoryTransport(str(tmp_path)).read_version(1)
    for name, t in hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())).items():
        assert torch.equal(got[name], t), name


def test_bf16_distributed_optimizer_packed_recompute_replay_on_cuda():
    """bf16 weights, fp32 main parameters in Megatron's distributed optimizer, packed rows, replay in recompute."""
    import dataclasses

    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions

    options = MegatronOptions(params_dtype="bfloat16", distributed_optimizer=True, recompute=True)
    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, packed=True), options=options)
    assert {p.dtype for p in learner.module.parameters()} == {torch.bfloat16}
    assert learner.mconfig.pipeline_dtype in (None, torch.bfloat16)
    inner = learner.optimizer.chained_optimizers[0] if hasattr(learner.optimizer, "chained_optimizers") else learner.optimizer
    assert isinstance(inner, DistributedOptimizer)
    main = [p for g in inner.shard_fp32_from_float16_groups for p in g]
    assert main and {p.dtype for p in main} == {torch.float32}
    seqs = make_sequences(tiny_spec(), n=6)
    packed = learner.logprobs(seqs, replay=True)
    learner.config = dataclasses.replace(learner.config, packed=False)
    padded = learner.logprobs(seqs, replay=True)
    learner.config = dataclasses.replace(learner.config, packed=True)
    assert max(float(abs(a - b).max()) for a, b in zip(packed, padded)) < 0.1  # bf16 rounding only
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    metrics = learner.train_step(seqs, replay=True)
    assert metrics["grad_norm"] > 0
    changed = [n for n, p in learner.module.named_parameters() if not torch.equal(before[n], p)]
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"
    torch.cuda.synchronize()


def test_a_loaded_checkpoint_survives_the_first_step_with_fp32_main_weights(tmp_path):
    """bf16 weights with the distributed optimizer keep fp32 main copies that every step writes back over the
    weights: `load_checkpoint` (init.hf's converted checkpoint) must refresh them, or the first step puts the random
    initial weights back (megatron-core: `reload_model_params` whenever weights change outside the optimizer)."""
    import torch

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions

    options = MegatronOptions(params_dtype="bfloat16", distributed_optimizer=True)
    source = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, seed=1), options=options)
    source.save_checkpoint(str(tmp_path / "ckpt"))
    saved = {n: p.detach().clone() for n, p in source.module.named_parameters()}
    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, seed=0), options=options)
    assert any(not torch.equal(saved[n], p) for n, p in learner.module.named_parameters()), "seeds differ"
    learner.load_checkpoint(str(tmp_path / "ckpt"))
    learner.set_lr(0.0)  # the step changes nothing of its own: what it writes back is the main copies
    learner.train_step(make_sequences(tiny_spec(), n=4), replay=True)
    reverted = [n for n, p in learner.module.named_parameters() if not torch.equal(saved[n], p)]
    assert not reverted, f"{len(reverted)} tensors lost the loaded weights at the first step: {reverted[:3]}"
