"""Build the configured learner and run one replayed forward: what the main job can do today."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def learner_preflight(run: Any, *, num_sequences: int = 4, seq_len: int = 24) -> Any:
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
    return learner


def engine_preflight(run: Any, learner: Any, *, prompts: int = 4, max_tokens: int = 16) -> dict[str, float]:
    """Export the learner to vLLM, sample with routing capture, replay that routing in the learner."""
    import tempfile

    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = run.model
    model_dir = export_learner(learner, tempfile.mkdtemp(prefix="moe_grpo_") + "/model")
    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, spec, max_model_len=min(spec.max_position_embeddings, 512))
    print(f"[engine] vLLM started in {time.perf_counter() - t0:.0f}s on {model_dir}")
    try:
        rng = np.random.default_rng(run.seed)
        batch = [list(map(int, rng.integers(3, spec.vocab_size, size=12))) for _ in range(prompts)]
        t0 = time.perf_counter()
        results = engine.generate(batch, SamplingSettings(n=2, max_tokens=max_tokens))
        seconds = time.perf_counter() - t0
        comps = [c for g in results for c in g]
        tokens = sum(len(c.token_ids) for c in comps)
        seqs = [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                                routing=c.routing, old_logprobs=c.logprobs) for c in comps]
        metrics = learner.forward_backward(seqs, replay=run.replay)
        learner.zero_grad()
        print(f"[engine] {len(comps)} completions, {tokens} tokens in {seconds:.1f}s "
              f"({tokens / seconds:.0f} tokens/s), trace {comps[0].routing.bytes_per_token} bytes/token; "
              f"learner replay/applied={metrics['replay/applied']:.2f}, mismatch/kl={metrics['mismatch/kl']:.2e}")
        return {"rollout_tokens_per_s": tokens / seconds, **metrics}
    finally:
        engine.shutdown()
