"""What the main job can do today: build the learner, replay routing, roll out, step, sync."""

from __future__ import annotations

import os
import shutil
import tempfile
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
    """Export the learner to vLLM, sample with routing capture, train one step on it with that routing
    replayed, and sync the new weights back into the engine."""
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = run.model
    workdir = tempfile.mkdtemp(prefix="moe_grpo_")
    model_dir = export_learner(learner, workdir + "/model")
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
        # No reward task exists yet: random advantages, so the step really moves the weights the sync then carries.
        seqs = [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                                routing=c.routing, old_logprobs=c.logprobs, advantage=float(rng.normal()))
                for c in comps]
        metrics = learner.train_step(seqs, replay=run.replay)
        print(f"[engine] {len(comps)} completions, {tokens} tokens in {seconds:.1f}s "
              f"({tokens / seconds:.0f} tokens/s), trace {comps[0].routing.bytes_per_token} bytes/token; "
              f"learner step on them (random advantages): replay/applied={metrics['replay/applied']:.2f}, "
              f"mismatch/kl={metrics['mismatch/kl']:.2e}")
        metrics.update(_sync_preflight(learner, engine, seqs))
        return {"rollout_tokens_per_s": tokens / seconds, **metrics}
    finally:
        engine.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


def _sync_preflight(learner: Any, engine: Any, seqs: list) -> dict[str, float]:
    """Publish the stepped weights as version 1, load them into the engine, compare log-probs."""
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport, default_root
    from moe_grpo.sync.weight_sync import WeightSync

    transport = SharedMemoryTransport(os.path.join(default_root(), f"preflight-{os.getpid()}"))
    try:
        report = WeightSync(learner, transport).sync(1).wait()
        apply_seconds = apply_version(engine, transport, 1)
        got = engine.score([s.tokens for s in seqs])
        want = learner.logprobs(seqs, replay=False)
        gap = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    finally:
        transport.unpin(engine.engine_id)
        transport.close()
    print(f"[sync] version 1: {report.bytes_written / 1e6:.1f} MB published in {report.seconds:.3f}s, "
          f"engine loaded it in {apply_seconds:.2f}s; max |logprob(vLLM) - logprob(learner)| = {gap:.1e}")
    return {**report.metrics(), "sync/apply_seconds": apply_seconds, "sync/max_logprob_gap": gap}
