"""Run inside spawned processes: the learner's whole CPU path with some megatron patches left out."""

from __future__ import annotations


def learner_path(skip: tuple[str, ...], tp: int, ep: int, pp: int, ckpt_dir: str) -> float:
    """Build, replayed forward, one train step, checkpoint save: everything the CPU patches cover."""
    from moe_grpo.learner import megatron_cpu

    megatron_cpu.apply(skip=skip)  # init_distributed's own apply() is then a no-op for the rest
    from layout_scenarios import make_sequences, shard, tiny_spec  # noqa: E402  (tests/learner on sys.path)

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout

    spec = tiny_spec()
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=1e-3))
    seqs = make_sequences(spec)
    _, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    learner.logprobs(mine, replay=True)
    metrics = learner.train_step(mine, replay=True)
    learner.save_checkpoint(ckpt_dir)
    return metrics["loss"]
