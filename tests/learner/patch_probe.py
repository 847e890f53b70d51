"""Run inside spawned processes: the learner's whole CPU path with some megatron patches left out."""

from __future__ import annotations


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def learner_path(skip: tuple[str, ...], tp: int, ep: int, pp: int, ckpt_dir: str, variant: str = "default") -> float:
    """Build, replayed forward, one train step, checkpoint save: everything the CPU patches cover."""
    from moe_grpo.learner import megatron_cpu

    megatron_cpu.apply(skip=skip)  # init_distributed's own apply() is then a no-op for the rest
    from layout_scenarios import make_sequences, shard, tiny_spec, tiny_v3_spec  # noqa: E402  (tests/learner on sys.path)

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.models.megatron import MegatronOptions

    spec = tiny_v3_spec() if variant == "mla" else tiny_v3_spec(extra_hf_config=dict(rope_scaling=YARN)) \
        if variant == "yarn" else tiny_spec()
    options = MegatronOptions(aux_loss_coeff=1e-3 if variant == "aux_loss" else 0.0)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=1e-3), options)
    seqs = make_sequences(spec)
    _, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    learner.logprobs(mine, replay=True)
    metrics = learner.train_step(mine, replay=True)
    learner.save_checkpoint(ckpt_dir)
    return metrics["loss"]


def learner_path_plain_mappings_view(tp: int, ep: int, pp: int, ckpt_dir: str) -> float:
    """Exploration helper: tp_mappings replaced by the plain device view (no split-size conversion)."""
    from moe_grpo.learner import megatron_cpu

    megatron_cpu.apply(skip=("tp_mappings",))
    megatron_cpu._torch_view_patch("megatron.core.tensor_parallel.mappings")()
    return learner_path((), tp, ep, pp, ckpt_dir)
