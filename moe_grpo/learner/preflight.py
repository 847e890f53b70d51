"""Build the configured learner and run one replayed forward: what the main job can do today."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def learner_preflight(run: Any, *, num_sequences: int = 4, seq_len: int = 24) -> dict[str, float]:
    """Build the Megatron learner for `run`, replay a random routing trace, report what happened."""
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import MegatronLearner
    from moe_grpo.routing.trace import RoutingTrace

    spec = run.model
    t0 = time.perf_counter()
    learner = MegatronLearner(spec, run.parallel, run.learner_config(), run.megatron_options())
    params = sum(p.numel() for p in learner.module.parameters())
    print(f"[learner] {spec.name}: {params / 1e6:.2f}M parameters on this rank, layout "
          f"TP={run.parallel.tensor_parallel} EP={run.parallel.expert_parallel} PP={run.parallel.pipeline_parallel}, "
          f"built in {time.perf_counter() - t0:.1f}s")
    rng = np.random.default_rng(run.seed)
    seqs = []
    for _ in range(num_sequences):
        tokens = rng.integers(0, spec.vocab_size, size=seq_len)
        ids = np.argsort(rng.random((seq_len - 1, spec.num_moe_layers, spec.num_experts)), axis=-1)[..., : spec.top_k]
        seqs.append(LearnerSequence(tokens, prompt_len=seq_len // 2, routing=RoutingTrace.from_array(ids, spec.num_experts)))
    t0 = time.perf_counter()
    logprobs = learner.logprobs(seqs, replay=run.replay)
    applied = learner.replayer.applied_fraction() if learner.replayer else 0.0
    mean_lp = float(np.mean(np.concatenate(logprobs)))
    print(f"[learner] forward of {num_sequences} x {seq_len} tokens in {time.perf_counter() - t0:.2f}s: "
          f"mean log-prob {mean_lp:.3f} (uniform would be {-np.log(spec.vocab_size):.3f}), "
          f"replay/applied={applied:.2f}")
    return {"params": float(params), "replay/applied": applied, "mean_logprob": mean_lp}
